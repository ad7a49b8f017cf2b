"""Each stage's wall time and peak GPU memory of a device run, from what `device_run.sh pipeline` brings back.

    python3 bench/gpu/stage_peaks.py --log snakemake-<run>.log [--log ...] --gpu gpu-<time>.csv [--gpu ...] \
        --out stage_peaks.json

The Snakemake log gives each job's window: the timestamp line before `rule X:` / `localrule X:` opens it, the one
before `Finished jobid: N (Rule: X)` or `Error in rule X:` closes it (a job cut by the call's time limit has no
close: its window ends at the log's last timestamp, marked `cut`). The GPU samples are `device_run.sh`'s nvidia-smi
rows (timestamp, memory.used, utilization.gpu, once a second); a stage's peak is the largest memory.used inside its
window. Several logs and sample files (one per call of a lease) are read together.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path

STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
START = re.compile(r"^(?:local)?rule (\w+):$")
FINISHED = re.compile(r"^Finished jobid: \d+ \(Rule: (\w+)\)$")
FAILED = re.compile(r"^Error in rule (\w+):$")
SECOND = timedelta(seconds=1)


@dataclass(frozen=True)
class StageWindow:
    rule: str
    start: datetime
    end: datetime
    status: str  # finished | failed | cut


@dataclass(frozen=True)
class StagePeak:
    rule: str
    start: str
    wall_s: float
    status: str
    peak_gpu_mib: int | None  # None: no sample inside the window
    mean_gpu_util_pct: float | None
    samples: int


def stage_windows(log_text: str) -> list[StageWindow]:
    """Job windows of one Snakemake log, in the order the jobs started."""
    windows: list[StageWindow] = []
    open_jobs: dict[str, datetime] = {}
    stamp: datetime | None = None
    for line in log_text.splitlines():
        line = line.rstrip()
        if m := STAMP.match(line):
            stamp = datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif (m := START.match(line)) and stamp is not None:
            open_jobs[m.group(1)] = stamp
        elif (m := FINISHED.match(line) or FAILED.match(line)) and stamp is not None and m.group(1) in open_jobs:
            status = "finished" if line.startswith("Finished") else "failed"
            windows.append(StageWindow(m.group(1), open_jobs.pop(m.group(1)), stamp, status))
    windows += [StageWindow(rule, start, stamp, "cut") for rule, start in open_jobs.items() if stamp is not None]
    return sorted(windows, key=lambda w: w.start)


def gpu_samples(csv_text: str) -> list[tuple[datetime, int, int]]:
    """(time, memory.used MiB, utilization %) of nvidia-smi's `--format=csv,noheader` rows."""
    rows = []
    for line in csv_text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            when = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            rows.append((when, int(parts[1].split()[0]), int(parts[2].split()[0])))
        except ValueError:
            continue
    return rows


def stage_peaks(windows: list[StageWindow], samples: list[tuple[datetime, int, int]]) -> list[StagePeak]:
    peaks = []
    for w in windows:
        # the log's stamps are whole seconds: a sample in the start's own second may be the previous job's tail
        inside = [(mem, util) for when, mem, util in samples if w.start + SECOND <= when <= w.end + SECOND]
        peaks.append(
            StagePeak(
                rule=w.rule,
                start=w.start.isoformat(),
                wall_s=(w.end - w.start).total_seconds(),
                status=w.status,
                peak_gpu_mib=max(m for m, _ in inside) if inside else None,
                mean_gpu_util_pct=round(sum(u for _, u in inside) / len(inside), 1) if inside else None,
                samples=len(inside),
            )
        )
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, action="append", required=True, help="a snakemake-<run>.log")
    parser.add_argument("--gpu", type=Path, action="append", default=[], help="a gpu-<time>.csv")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    windows = [w for log in args.log for w in stage_windows(log.read_text())]
    samples = [s for csv in args.gpu for s in gpu_samples(csv.read_text())]
    peaks = stage_peaks(sorted(windows, key=lambda w: w.start), samples)
    for p in peaks:
        mem = f"{p.peak_gpu_mib / 1024:.1f} GiB" if p.peak_gpu_mib is not None else "-"
        print(f"{p.start}  {p.rule:28s} {p.wall_s:7.0f} s  peak {mem:>9s}  {p.status}")
    if args.out:
        args.out.write_text(json.dumps([asdict(p) for p in peaks], indent=1) + "\n")


if __name__ == "__main__":
    main()
