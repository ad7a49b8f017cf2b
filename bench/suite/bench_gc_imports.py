"""What CPython's cyclic garbage collector costs the imports every stage process starts with: vLLM's OpenAI server
(each CPU vLLM server of the canary, extraction and online training), vLLM (evaluation's engines, check_api),
speculators (the trainer) and Snakemake (every job), each imported in a fresh interpreter with Python's default
thresholds (700, 10, 10), with the thresholds every interpreter of this environment starts with, with the collector
off, and as the environment runs it: its thresholds and gc.freeze() at exit, which skips the finalization's
collections (envs/setup_cpu.sh writes both into a .pth file). Each figure includes the interpreter's exit. Side by
side in one run, interleaved, CPU seconds (user + system) of each import; the median of --repeats and the ratio to
the default.

usage: .venv/bin/python bench/suite/bench_gc_imports.py [--repeats 5] [--thresholds 50000,20,100 ...]
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODULES = ("vllm.entrypoints.openai.api_server", "vllm", "speculators", "snakemake.api")


def import_cpu_seconds(module: str, setup: str) -> float:
    """CPU seconds of a fresh interpreter that runs `setup`, then imports `module`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"{setup}\nimport {module}"], check=True, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def environment_thresholds() -> tuple[int, ...]:
    """The thresholds a fresh interpreter of this environment starts with."""
    out = subprocess.run([sys.executable, "-c", "import gc; print(*gc.get_threshold())"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return tuple(int(v) for v in out.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--thresholds", nargs="*", default=[], help="more threshold triples to compare, e.g. 10000,10,10"
    )
    args = parser.parse_args()

    # every setting but the environment's own leaves out the .pth's gc.freeze at exit (atexit.unregister)
    no_freeze = "import atexit, gc; atexit.unregister(gc.freeze); "
    settings = {"default (700, 10, 10)": no_freeze + "gc.set_threshold(700, 10, 10)",
                f"thresholds {environment_thresholds()}": no_freeze + "pass"}  # fmt: skip
    for triple in args.thresholds:
        values = tuple(int(v) for v in triple.split(","))
        settings[f"thresholds {values}"] = no_freeze + f"gc.set_threshold{values}"
    settings["off"] = no_freeze + "gc.disable()"
    settings["this environment: thresholds + freeze at exit"] = "pass"

    print(f"{platform.node()}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"Python {platform.python_version()}, {args.repeats} repeats, interleaved")  # fmt: skip
    for module in MODULES:
        import_cpu_seconds(module, "pass")  # bytecode caches and the page cache warm, not counted
        runs: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.repeats):
            for name, setup in settings.items():
                runs[name].append(import_cpu_seconds(module, setup))
        default = statistics.median(runs["default (700, 10, 10)"])
        print(f"\nimport {module}: CPU seconds, median of {args.repeats} (min-max) | / default")
        for name, values in runs.items():
            median = statistics.median(values)
            print(f"  {name:46} {median:6.2f} ({min(values):.2f}-{max(values):.2f}) | {median / default:.2f}")


if __name__ == "__main__":
    main()
