"""Online against offline hidden states, side by side in one run: the whole workflow twice on the same config,
data and seed (train.hidden_states: offline, then online), each in its own work folder.

usage: python bench/online/online_vs_offline.py --work DIR [--config FILE ...] [--out FILE.json] [--cores N]

Per mode: Snakemake's wall time to eval/acceptance.json, the high-water mark of the run folder's size (sampled every
0.2 s by walking the folder; hidden-state files included, the target and the .snakemake folder too), the mean
acceptance length the evaluation measured, train_draft's own wall time, and for online what the trainer's server
did (samples checked, peak files on disk at once). Ratios are online / offline. Without --config: the tiny preset
(config/config.yaml).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # deleted between listing and stat: the trainer consumed it
    return total


class HighWater(threading.Thread):
    """The largest size a folder reached while it ran (sampled every `interval_s`)."""

    def __init__(self, folder: Path, interval_s: float = 0.2):
        super().__init__(daemon=True)
        self.folder, self.interval_s, self.peak, self.done = folder, interval_s, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            if self.folder.exists():
                self.peak = max(self.peak, folder_bytes(self.folder))

    def stop(self) -> int:
        self.done.set()
        self.join()
        if self.folder.exists():
            self.peak = max(self.peak, folder_bytes(self.folder))
        return self.peak


def run_mode(mode: str, work: Path, configs: list[Path], cores: int) -> dict:
    folder = work / mode
    folder.mkdir(parents=True, exist_ok=True)
    overlay = folder / "mode.yaml"
    overlay.write_text(f"train:\n  hidden_states: {mode}\n", encoding="utf-8")
    run = next((c["run"] for c in map(yaml.safe_load, map(Path.read_text, reversed(configs))) if c.get("run")), "tiny")
    command = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", str(cores),
               f"results/{run}/eval/acceptance.json", "--configfile", *map(str, configs), str(overlay)]  # fmt: skip
    watch = HighWater(folder / "results" / run)
    watch.start()
    started = time.monotonic()
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    peak = watch.stop()
    (folder / "snakemake.log").write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: snakemake exited {proc.returncode}; see {folder / 'snakemake.log'}")
    results = folder / "results" / run
    acceptance = json.loads((results / "eval" / "acceptance.json").read_text())
    training = json.loads((results / "draft" / "training.json").read_text())
    trained = acceptance["trained"]
    return {
        "mode": mode,
        "snakemake_wall_s": round(wall, 1),
        "peak_run_folder_bytes": peak,
        "mean_acceptance_length": trained["mean_acceptance_length"],
        "acceptance_per_position": trained["per_position_acceptance"],
        "untrained_mean_acceptance_length": acceptance["untrained"]["mean_acceptance_length"],
        "train_draft_wall_s": training["wall_s"],
        "train_steps": training["steps"],
        "final_val_loss": training["final_val_loss"],
        "online": training.get("online"),
    }


def online_over_offline(offline: dict, online: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """online / offline for each key both measured (both benches' ratio column)."""
    return {
        key: round(online[key] / offline[key], 3) for key in keys if offline.get(key) and online.get(key) is not None
    }


def emit(report: dict, out: Path | None) -> None:
    """The report as JSON on stdout, and into `out` when given."""
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--config", type=Path, action="append", default=None)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    configs = [c.resolve() for c in (args.config or [REPO / "config" / "config.yaml"])]
    rows = [run_mode(mode, args.work.resolve(), configs, args.cores) for mode in ("offline", "online")]
    offline, online = rows
    ratios = online_over_offline(
        offline, online, ("snakemake_wall_s", "peak_run_folder_bytes", "train_draft_wall_s", "mean_acceptance_length")
    )
    report = {"configs": [str(c) for c in configs], "modes": rows, "online_over_offline": ratios}
    emit(report, args.out)


if __name__ == "__main__":
    main()
