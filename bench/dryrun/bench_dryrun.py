"""How long does planning a 500,000-sample, 64-replica run take? Goal: <= 5 s for `snakemake -n`.

Times the real command a user types (`snakemake -n --profile profiles/slurm --configfile ...`, process start
included) on the llama-3.1-8b preset + bench/dryrun/config.yaml, with a generated 500,000-conversation
ShareGPT file and a target directory holding only config.json (bench/out/, git-ignored). The tiny preset's
dry run, timed the same way in the same script, is the baseline. Prints the median of --repeats runs, the
ratio to the 5 s goal and the ratio to the baseline.

    .venv/bin/python bench/dryrun/bench_dryrun.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "bench" / "out" / "dryrun"
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
GOAL_S = 5.0
SAMPLES = 500_000


def write_dataset(path: Path, samples: int) -> None:
    if path.exists() and sum(1 for _ in path.open()) == samples:
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(samples):
            record = {
                "conversations": [
                    {"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                    {"from": "gpt", "value": f"{i} + {i} = {2 * i}."},
                ]
            }
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)


def prepare_inputs() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    model = OUT / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096}))
    data = OUT / "conversations_500k.jsonl"
    write_dataset(data, SAMPLES)
    paths = OUT / "paths.yaml"
    paths.write_text(
        yaml.safe_dump(
            {"target": {"path": str(model)}, "data": {"sources": [{"path": str(data), "format": "sharegpt"}]}}
        )
    )
    return paths


def dry_run(configfiles: list[Path], workdir: Path) -> tuple[float, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SNAKEMAKE_SLURM_OVERRIDES": os.devnull}
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(workdir),
        "-n",
        "--quiet",
        "rules",
        "--profile",
        str(REPO / "profiles" / "slurm"),
        "--configfile",
        *map(str, configfiles),
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=600)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"dry run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return elapsed, proc.stdout + proc.stderr


def planned_jobs(text: str, rule: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == rule and parts[1].isdigit():
            return int(parts[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    started = time.perf_counter()
    paths = prepare_inputs()
    print(f"inputs ready in {time.perf_counter() - started:.1f} s ({SAMPLES:,} samples)")
    big = [REPO / "config" / "presets" / "llama-3.1-8b.yaml", REPO / "bench" / "dryrun" / "config.yaml", paths]
    tiny = [REPO / "config" / "presets" / "tiny.yaml"]

    big_times, tiny_times = [], []
    for _ in range(args.repeats):
        elapsed, text = dry_run(big, OUT / "work-500k")
        big_times.append(elapsed)
        elapsed, _ = dry_run(tiny, OUT / "work-tiny")
        tiny_times.append(elapsed)
    replicas = planned_jobs(text, "extract_hidden_states")
    if replicas != 64:
        raise SystemExit(f"expected 64 extraction jobs in the plan, found {replicas}:\n{text[-3000:]}")
    total = planned_jobs(text, "total")

    big_s, tiny_s = statistics.median(big_times), statistics.median(tiny_times)
    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(
        f"dry run, {SAMPLES:,} samples / 64 replicas ({total} jobs): median {big_s:.2f} s of {args.repeats} "
        f"({', '.join(f'{t:.2f}' for t in big_times)})"
    )
    print(f"ratio to the {GOAL_S:.0f} s goal: {big_s / GOAL_S:.2f} ({'met' if big_s <= GOAL_S else 'MISSED'})")
    print(f"baseline, tiny preset dry run: median {tiny_s:.2f} s; 500k/tiny ratio {big_s / tiny_s:.2f}")
    if big_s > GOAL_S:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
