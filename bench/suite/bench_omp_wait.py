"""The train_draft rule with OpenMP's threads spinning at barriers (OMP_WAIT_POLICY=ACTIVE, GNU OpenMP's default
behaviour) against sleeping (PASSIVE, what training.launcher.trainer_env sets on CPU and tests/conftest.py sets for the
suite), side by side in one run, alternating: alone, then beside `--busy` processes that keep a core each busy (as the
suite's other workers do). Wall and CPU seconds of each run and the ratio PASSIVE / ACTIVE.

It works on a copy of a finished run (`make demo` leaves results/tiny): its results, Snakemake's metadata and the
preset's data go into a scratch folder, where each run deletes train_work/ and draft/ and asks Snakemake for
`-R train_draft --until train_draft` (the rule as the workflow runs it, the trainer started from scratch).

usage: .venv/bin/python bench/suite/bench_omp_wait.py [config/presets/tiny.yaml] [--busy 2] [--repeats 1]
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
POLICIES = ("ACTIVE", "PASSIVE")


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
        raise SystemExit(f"train_draft failed ({policy}):\n{proc.stderr[-4000:]}")
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
    args = parser.parse_args()
    work, config = scratch_copy(args.preset)
    print(f"{platform.node()}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"preset {args.preset.name}, scratch {work}")  # fmt: skip
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for load in ("alone", f"beside {args.busy} busy"):
            hogs = busy_processes(args.busy) if load != "alone" else []
            try:
                for _ in range(args.repeats):
                    for policy in POLICIES:
                        wall, cpu = train_once(work, args.preset, config["run"], policy)
                        results.setdefault((load, policy), []).append((wall, cpu))
                        print(f"  {load:>16} {policy:>7}: {wall:6.1f} s wall, {cpu:6.1f} CPU-s", flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\nload             | ACTIVE wall (CPU) | PASSIVE wall (CPU) | PASSIVE / ACTIVE wall (CPU), best of each")
    for load in ("alone", f"beside {args.busy} busy"):
        active = min(results[(load, "ACTIVE")])
        passive = min(results[(load, "PASSIVE")])
        print(f"{load:16} | {active[0]:6.1f} s ({active[1]:5.1f}) | {passive[0]:6.1f} s ({passive[1]:5.1f})  | "
              f"{passive[0] / active[0]:.2f} ({passive[1] / active[1]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
