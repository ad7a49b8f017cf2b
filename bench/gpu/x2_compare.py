"""Figures of bench/gpu/x2_proof.sh's runs (issue 14 on two GPUs), as one JSON object on stdout.

usage: python bench/gpu/x2_compare.py --results results --out-dir $OUT/x2

- extraction: tok/s and wall per replica manifest of gpu-x2-tp1 / gpu-x2-tp2 / gpu-x2-r2, ratio TP=2 / TP=1;
  the 2-replica run's extraction phase (first replica start to last replica end, from the manifests' wall_s and
  the logs' timestamps) against tp1's
- placement: the GPU ids each replica job logged ("gpu placement: holding GPU(s) ...")
- identical: every hidden-state file of gpu-x2-r2 against gpu-x2-tp1's (the same rows): bitwise equal or not,
  and the largest |difference|
- training: ddp1 / ddp2 training.json (steps, wall_s) and metrics.csv train loss per step side by side
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from datetime import datetime
from pathlib import Path

PLACEMENT = re.compile(r"gpu placement: holding GPU\(s\) (\S+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) ")


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def log_span(log: Path) -> tuple[datetime, datetime] | None:
    """First and last timestamp of a stage log (setup_logging's format)."""
    if not log.exists():
        return None
    stamps = [m.group(1) for line in log.read_text(errors="replace").splitlines() if (m := STAMP.match(line))]
    if not stamps:
        return None
    parse = lambda s: datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    return parse(stamps[0]), parse(stamps[-1])


def extraction(results: Path, run: str) -> dict:
    manifests = sorted((results / run / "hidden_states").glob("replica_*.json"))
    logs = sorted((results / run / "logs").glob("extract_hidden_states_replica_*.log"))
    spans = [s for s in map(log_span, logs) if s]
    placed = {log.stem: PLACEMENT.findall(log.read_text(errors="replace")) for log in logs}
    rows = [load(m) for m in manifests]
    return {
        "replicas": [
            {k: r.get(k) for k in ("replica", "tokens", "tokens_per_s", "wall_s", "server_ready_s")} for r in rows
        ],
        "tokens_per_s_total": round(sum(r.get("tokens_per_s", 0) for r in rows), 1),
        "phase_wall_s": round((max(e for _, e in spans) - min(s for s, _ in spans)).total_seconds(), 1)
        if spans
        else None,
        "gpus_logged": placed,
    }


def same_hidden_states(a_dir: Path, b_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    compared, bitwise, worst = 0, 0, 0.0
    for a_file in sorted(a_dir.glob("hs_*.safetensors")):
        b_file = b_dir / a_file.name
        if not b_file.exists():
            continue
        a, b = load_file(str(a_file)), load_file(str(b_file))
        compared += 1
        equal = all(torch.equal(a[k], b[k]) for k in a)
        bitwise += equal
        if not equal:
            diff = (a["hidden_states"].float() - b["hidden_states"].float()).abs().max().item()
            worst = max(worst, diff)
    return {"files_compared": compared, "bitwise_equal": bitwise, "max_abs_diff": worst}


def train_loss(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    with path.open() as f:
        return {int(r["global_step"]): float(r["loss"]) for r in csv.DictReader(f) if r.get("split") == "train"}


def training(out_dir: Path) -> dict:
    runs = {name: load(out_dir / name / "training.json") or {} for name in ("ddp1", "ddp2")}
    losses = {name: train_loss(out_dir / name / "metrics.csv") for name in runs}
    steps_per_s = {n: round(r["steps"] / r["wall_s"], 4) if r.get("wall_s") else None for n, r in runs.items()}
    one, two = steps_per_s.get("ddp1"), steps_per_s.get("ddp2")
    common = sorted(set(losses["ddp1"]) & set(losses["ddp2"]))
    return {
        "summary": {
            n: {k: r.get(k) for k in ("device", "processes", "steps", "wall_s", "final_train_loss")}
            for n, r in runs.items()
        },
        "steps_per_s": steps_per_s,
        "steps_per_s_ratio_2_over_1": round(two / one, 3) if one and two else None,
        "loss_by_step": {step: [losses["ddp1"][step], losses["ddp2"][step]] for step in common},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()
    runs = {name: extraction(args.results, f"gpu-x2-{name}") for name in ("tp1", "tp2", "r2")}
    one, two = runs["tp1"]["tokens_per_s_total"], runs["tp2"]["tokens_per_s_total"]
    report = {
        "extraction": runs,
        "tp2_over_tp1_tokens_per_s": round(two / one, 3) if one and two else None,
        "r2_phase_over_tp1_phase": (
            round(runs["r2"]["phase_wall_s"] / runs["tp1"]["phase_wall_s"], 3)
            if runs["r2"]["phase_wall_s"] and runs["tp1"]["phase_wall_s"]
            else None
        ),
        "r2_equals_tp1": same_hidden_states(
            args.results / "gpu-x2-r2" / "hidden_states" / "files",
            args.results / "gpu-x2-tp1" / "hidden_states" / "files",
        ),
        "training": training(args.out_dir),
    }
    print(json.dumps(report, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
