"""The train_draft rule with GNU OpenMP's default waiting (its threads spin a while at each barrier before they sleep:
what the trainer had before training.launcher.trainer_env set PASSIVE on CPU) against PASSIVE (they sleep at once;
tests/conftest.py sets it for the suite), and `--active` adds ACTIVE (they never stop spinning). Side by side in one
run, alternating: alone, then beside `--busy` processes that keep a core each busy (as the suite's other workers do).
Wall and CPU seconds of each run and the ratio PASSIVE / default.

The default is asked for with OMP_WAIT_POLICY set but empty: trainer_env keeps a value the environment gives, and GNU
OpenMP ignores the empty one (it prints "Invalid value for environment variable OMP_WAIT_POLICY" into the trainer's log)
and keeps its default.

It works on a copy of a finished run (`make demo` leaves results/tiny): its results, Snakemake's metadata and the
preset's data go into a scratch folder, where each run deletes train_work/ and draft/ and asks Snakemake for
`-R train_draft --until train_draft` (the rule as the workflow runs it, the trainer started from scratch).

usage: .venv/bin/python bench/suite/bench_omp_wait.py [config/presets/tiny.yaml] [--busy 2] [--repeats 1] [--active]
"""

from __future__ import annotations

import argparse
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
DEFAULT = ""  # GNU OpenMP's own default (see the docstring)


def label(policy: str) -> str:
    return policy or "default"


def scratch_copy(preset: Path) -> tuple[Path, dict]:
    """The finished run of `preset` in a scratch folder with what Snakemake needs to plan only train_draft."""
    config = yaml.safe_load(preset.read_text())
    run_dir = REPO / "results" / config["run"]
    if not (run_dir / "hidden_states" / "validation.json").exists():
        raise SystemExit(f"{run_dir} has no validated hidden states: run `make demo PRESET={preset}` first")
    work = Path(tempfile.mkdtemp(prefix="bench-omp-wait-"))
    shutil.copytree(run_dir, work / "results" / config["run"], symlinks=True)
    shutil.copytree(REPO / ".snakemake" / "metadata", work / ".snakemake" / "metadata")
    for source in config["data"]["sources"]:
        (work / source["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / source["path"], work / source["path"])
    return work, config


def train_once(work: Path, preset: Path, run: str, policy: str) -> tuple[float, float]:
    """train_draft from scratch with OMP_WAIT_POLICY=policy: (wall s, CPU s of Snakemake and everything it waited for)."""
    for folder in ("train_work", "draft"):
        shutil.rmtree(work / "results" / run / folder, ignore_errors=True)
    command = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-d", str(work), "--cores", "2", "-R", "train_draft",
               "--until", "train_draft", "--configfile", str(preset.resolve())]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, env=environment(policy))
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"train_draft failed ({label(policy)}):\n{proc.stderr[-4000:]}")
    log = (work / "results" / run / "logs" / "train_draft.log").read_text()
    if "resuming from checkpoint" in log:
        raise SystemExit("train_draft resumed instead of training from scratch: the measurement would be wrong")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def environment(policy: str) -> dict[str, str]:
    import os

    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", type=Path, nargs="?", default=REPO / "config" / "presets" / "tiny.yaml")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded runs")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--active", action="store_true", help="also OMP_WAIT_POLICY=ACTIVE")
    args = parser.parse_args()
    policies = (DEFAULT, "PASSIVE", *(("ACTIVE",) if args.active else ()))
    work, config = scratch_copy(args.preset)
    print(f"{platform.node()}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"preset {args.preset.name}, scratch {work}")  # fmt: skip
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        # the first training in a fresh copy is slow whatever the policy (69-71 s against 19-25 s after it, measured
        # 2026-12-04): one run, not counted, before the measured ones
        wall, cpu = train_once(work, args.preset, config["run"], "PASSIVE")
        print(f"  {'warm-up':>16} PASSIVE: {wall:6.1f} s wall, {cpu:6.1f} CPU-s (not counted)", flush=True)
        for load in ("alone", f"beside {args.busy} busy"):
            hogs = busy_processes(args.busy) if load != "alone" else []
            try:
                for _ in range(args.repeats):
                    for policy in policies:
                        wall, cpu = train_once(work, args.preset, config["run"], policy)
                        results.setdefault((load, policy), []).append((wall, cpu))
                        print(f"  {load:>16} {label(policy):>7}: {wall:6.1f} s wall, {cpu:6.1f} CPU-s", flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nload             | policy  | wall (CPU-s), best of each | / default wall (CPU)")
    for load in ("alone", f"beside {args.busy} busy"):
        default = min(results[(load, DEFAULT)])
        for policy in policies:
            wall, cpu = min(results[(load, policy)])
            print(f"{load:16} | {label(policy):7} | {wall:6.1f} s ({cpu:5.1f})          | "
                  f"{wall / default[0]:.2f} ({cpu / default[1]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
