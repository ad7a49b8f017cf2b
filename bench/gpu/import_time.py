"""How long a fresh process takes to `import vllm`, with the installed bytecode and without it, side by side.

    python3 bench/gpu/import_time.py [--module vllm] [--pairs 3] [--out import_time.json]

Why: on the 8B-shape lease of 2026-12-06 `import vllm` took 10.3-14.9 s in each of five evaluation processes, the
later ones no faster than the first (bench/gpu/results/2026-12-06-llama8b-shape-speed/). bench/gpu/install.sh now
compiles the carried packages' bytecode once after pip's `--no-compile` install. This bench says what that saves:
alternating pairs of fresh interpreters, one reading the installed `__pycache__` (what every stage does), one made
to compile from source and write nothing (PYTHONPYCACHEPREFIX on an empty folder, PYTHONDONTWRITEBYTECODE=1: what a
process saw before the change when it could not write bytecode). The from-source side compiles every module, the
image's own torch too, which had its bytecode before the change as well: `import torch` is timed the same way, so
that its excess can be taken off (what the change saves is about vllm's gap less torch's). Runs anywhere the module
imports: on the CPU `.venv` too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def summarise(seconds: list[float]) -> dict[str, float]:
    """Median and spread of one condition's wall times."""
    return {
        "median_s": round(statistics.median(seconds), 3),
        "min_s": round(min(seconds), 3),
        "max_s": round(max(seconds), 3),
        "runs": len(seconds),
    }


def ratios(with_bytecode: list[float], from_source: list[float]) -> dict[str, float]:
    """from_source / with_bytecode per pair (> 1: the bytecode saves time), the median and the spread."""
    per_pair = [s / b for b, s in zip(with_bytecode, from_source, strict=True)]
    return {
        "median": round(statistics.median(per_pair), 3),
        "min": round(min(per_pair), 3),
        "max": round(max(per_pair), 3),
    }


def timed_import(module: str, env: dict[str, str]) -> float:
    """Wall seconds of a fresh interpreter that imports `module` and exits; raises with its stderr if it fails."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"import {module} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def measure(module: str, pairs: int, empty_prefix: Path) -> dict[str, list[float]]:
    """Alternating pairs: installed bytecode first, then from source, so drift hits both sides alike."""
    installed = dict(os.environ)
    installed.pop("PYTHONPYCACHEPREFIX", None)
    from_source = dict(installed, PYTHONPYCACHEPREFIX=str(empty_prefix), PYTHONDONTWRITEBYTECODE="1")
    times: dict[str, list[float]] = {"with_bytecode": [], "from_source": []}
    timed_import(module, installed)  # warm the page cache for both sides
    for pair in range(pairs):
        times["with_bytecode"].append(timed_import(module, installed))
        times["from_source"].append(timed_import(module, from_source))
        print(
            f"pair {pair + 1}/{pairs}: import {module} {times['with_bytecode'][-1]:.2f} s with the bytecode, "
            f"{times['from_source'][-1]:.2f} s from source",
            flush=True,
        )
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="vllm")
    parser.add_argument(
        "--floor-module",
        default="torch",
        help="timed the same way: its gap is the part of the first module's that the image already had compiled",
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("import_time.json"))
    args = parser.parse_args()
    result: dict[str, object] = {"python": sys.version.split()[0], "pairs": args.pairs}
    with tempfile.TemporaryDirectory(prefix="empty-pycache-") as empty:
        for name in (args.floor_module, args.module):
            times = measure(name, args.pairs, Path(empty))
            leftover = sum(1 for _ in Path(empty).rglob("*.pyc"))
            if leftover:
                raise RuntimeError(f"the from-source side wrote {leftover} .pyc files: its times are not from source")
            result[name] = {
                "with_bytecode": summarise(times["with_bytecode"]),
                "from_source": summarise(times["from_source"]),
                "from_source_over_with_bytecode": ratios(times["with_bytecode"], times["from_source"]),
                "seconds": times,
            }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in (args.floor_module, args.module):
        bytecode, source, ratio = (
            result[name][k] for k in ("with_bytecode", "from_source", "from_source_over_with_bytecode")
        )
        print(
            f"import {name}: {bytecode['median_s']} s with the bytecode, {source['median_s']} s from source "
            f"(ratio {ratio['median']}, {ratio['min']}-{ratio['max']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
