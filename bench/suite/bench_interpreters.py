"""Which Python 3.11 the CPU environment should run on: the same packages (the lock) installed into a venv of each
interpreter, and the imports every stage process starts with timed in each: vLLM's OpenAI server (each CPU vLLM
server of the canary, extraction and online training), vLLM (evaluation's engines, check_api), speculators (the
trainer), Snakemake (every job), and a pure-Python loop as a control. Side by side in one run, interleaved, CPU
seconds (user + system) of a fresh interpreter each time; the median of --repeats and the ratio to the first venv.

Build the second venv as envs/setup_cpu.sh builds .venv, with another interpreter:
  PYTHON=/usr/bin/python3.11 VENV_DIR=/tmp/venv-debian bash envs/setup_cpu.sh

usage: .venv/bin/python bench/suite/bench_interpreters.py VENV [VENV ...] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOOP = "d = {}\nfor i in range(3_000_000):\n    d[i % 1000] = d.get(i % 1000, 0) + i\nsorted(str(i) for i in range(500_000))"
WORKLOADS = {
    "import vllm.entrypoints.openai.api_server": "import vllm.entrypoints.openai.api_server",
    "import vllm": "import vllm",
    "import speculators": "import speculators",
    "import snakemake.api": "import snakemake.api",
    "pure-Python loop": LOOP,
}


def cpu_seconds(python: Path, code: str) -> float:
    """CPU seconds of a fresh interpreter `python` running `code` (its exit included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([str(python), "-c", code], check=True, cwd=REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def describe(python: Path) -> str:
    code = "import os, sys; print(os.path.realpath(sys._base_executable), sys.version.split()[0])"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venvs", nargs="+", type=Path, help="venv folders (the first is the baseline)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pythons = [venv / "bin" / "python" for venv in args.venvs]
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {platform.node()} ({platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores)")  # fmt: skip
    for venv, python in zip(args.venvs, pythons, strict=True):
        print(f"  {venv}: {describe(python)}")
    for python in pythons:  # warm the page cache and the .pyc files: the first import of a fresh venv is no figure
        cpu_seconds(python, "import vllm.entrypoints.openai.api_server, speculators, snakemake.api")
    print(f"\nCPU seconds, median of {args.repeats} (interleaved); ratio to {args.venvs[0]}")
    for name, code in WORKLOADS.items():
        samples: list[list[float]] = [[] for _ in pythons]
        for _ in range(args.repeats):
            for i, python in enumerate(pythons):
                samples[i].append(cpu_seconds(python, code))
        medians = [statistics.median(s) for s in samples]
        cells = "  ".join(f"{m:6.2f} s ({m / medians[0]:.2f}x)" for m in medians)
        print(f"  {name:42s} {cells}")


if __name__ == "__main__":
    main()
