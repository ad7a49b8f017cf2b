"""A device run's per-stage costs, and the forecast made before it set against them (issue #42).

    python3 bench/gpu/forecast_check.py --run <run folder> --stage-peaks stage_peaks.json --du du-<run>.txt \
        --forecast forecast_before.json --gpus 1 --out-stages stages.json --out-forecast forecast.json

Inputs, all from what `device_run.sh pipeline collect` brings back:
- the run folder (the results tarball unpacked): the stages' own artefacts (replica manifests, training.json, the
  trainer's metrics JSONL);
- stage_peaks.json (bench/gpu/stage_peaks.py): each stage's wall and peak GPU memory, per attempt;
- du-<run>.txt (`du -ab` of the run folder on the machine, before anything was left out): what each stage wrote;
  --du again for each call's snapshot: each path at the largest size any of them shows (du_sizes_largest);
- the forecast's JSON (`python -m eagle3_workflow.forecast --json`), made with the cost table as it stood before the
  run: the check is only a validation when the run's own figures are not in that table.

stages.json: per stage, wall (the finished attempt's; cut attempts listed apart), GPU-seconds (wall x GPUs held),
peak GPU memory, bytes written, tokens/s. forecast.json: {"stages": [{"stage", "quantity", "forecast", "measured",
"unit", "ratio", "within_25pct"}]}; the quantities `start` and `per_token` set the two parts of a stage's wall
(the part paid once, the part that grows with the tokens) against the measured split, so a miss says which part
missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

# the folders of the run each stage writes (du's rows are summed over them)
STAGE_OUTPUTS = {
    "prepare_data": ["data"],
    "canary": ["checks/canary_work"],
    "extract_hidden_states": ["hidden_states"],
    "train_draft": ["train_work", "draft"],
    "evaluate_draft": ["eval"],
}
TOLERANCE = 0.25  # the bar: the forecast within 25% of the measurement, per stage


def du_sizes(du_text: str, run_root: str) -> dict[str, int]:
    """`du -ab` rows (bytes, path) as sizes keyed by the path relative to the run folder."""
    sizes = {}
    root = run_root.rstrip("/") + "/"
    for line in du_text.splitlines():
        size, _, path = line.partition("\t") if "\t" in line else line.partition(" ")
        if path.startswith(root):
            sizes[path[len(root) :]] = int(size)
    return sizes


def du_sizes_largest(du_texts: list[str], run_root: str) -> dict[str, int]:
    """Several `du -ab` snapshots of one run (one per device call) merged: each path at the largest size seen. du
    counts a hard-linked file once, under the first path it meets, so a snapshot taken after package_draft had
    hard-linked the draft's weights into published_draft/ showed draft/ at 0 bytes (2026-12-07); the snapshot
    taken after train_draft holds its 1.90 GB. `device_run.sh collect` now runs du with --count-links."""
    merged: dict[str, int] = {}
    for text in du_texts:
        for path, size in du_sizes(text, run_root).items():
            merged[path] = max(size, merged.get(path, 0))
    return merged


def training_split(metrics_rows: list[dict[str, Any]]) -> dict[str, float]:
    """The trainer's logged steps: the first step (compilation, cold DataLoader), the steady steps' seconds and
    tokens, and their median rate."""
    steps = [r["metrics"]["profile"] for r in metrics_rows if "profile" in r.get("metrics", {})]
    if not steps:
        raise SystemExit("forecast_check: the trainer's metrics JSONL has no step with a profile")
    steady = steps[1:]
    steady_s = sum(p["step_ms"] for p in steady) / 1000
    steady_tokens = sum(p["tokens_per_s"] * p["step_ms"] / 1000 for p in steady)
    return {
        "first_step_s": steps[0]["step_ms"] / 1000,
        "steady_steps": len(steady),
        "steady_s": round(steady_s, 2),
        "steady_tokens": round(steady_tokens),
        "steady_tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s else 0.0,
        "median_step_tokens_per_s": round(statistics.median(p["tokens_per_s"] for p in steady), 1) if steady else 0.0,
    }


def measured_stages(
    peaks: list[dict[str, Any]], sizes: dict[str, int], artefacts: dict[str, Any], gpus: int
) -> list[dict[str, Any]]:
    """One row per stage: the finished attempt's wall, GPU-seconds and peak; earlier or cut attempts apart."""
    rows: dict[str, dict[str, Any]] = {}
    for peak in peaks:
        row = rows.setdefault(peak["rule"], {"stage": peak["rule"], "attempts": []})
        row["attempts"].append({k: peak[k] for k in ("start", "wall_s", "status", "peak_gpu_mib")})
    for row in rows.values():
        done = [a for a in row["attempts"] if a["status"] == "finished"]
        last = done[-1] if done else None
        row["status"] = "finished" if last else row["attempts"][-1]["status"]
        row["wall_s"] = last["wall_s"] if last else None
        row["wall_s_all_attempts"] = sum(a["wall_s"] for a in row["attempts"])
        gpu_peaks = [a["peak_gpu_mib"] for a in row["attempts"] if a["peak_gpu_mib"] is not None]
        row["peak_gpu_mib"] = max(gpu_peaks) if gpu_peaks else None
        used_gpu = bool(row["peak_gpu_mib"]) and row["peak_gpu_mib"] > 1024  # a CPU stage's window shows ~0 MiB
        row["gpu_s"] = round(gpus * row["wall_s_all_attempts"], 1) if used_gpu else 0.0
        outputs = STAGE_OUTPUTS.get(row["stage"], [])
        row["disk_bytes"] = sum(sizes.get(p, 0) for p in outputs) if outputs else None
    replica = artefacts.get("replica")
    if replica and "extract_hidden_states" in rows:
        rows["extract_hidden_states"] |= {
            "tokens": replica["tokens"],
            "tokens_per_s": replica["tokens_per_s"],
            "start_s": replica["server_ready_s"],
            "per_token_s": round(replica["tokens"] / replica["tokens_per_s"], 2),
        }
    split = artefacts.get("training_split")
    if split and "train_draft" in rows:
        rows["train_draft"] |= {
            "tokens": split["steady_tokens"],
            "tokens_per_s": split["steady_tokens_per_s"],
            "first_step_s": split["first_step_s"],
            "per_token_s": split["steady_s"],
            "start_s": round(rows["train_draft"]["wall_s"] - split["steady_s"], 1),
        }
    return list(rows.values())


def compare(forecast: dict[str, Any], stages: list[dict[str, Any]], costs_note: str) -> dict[str, Any]:
    """The forecast's figures beside the measured ones, per stage and quantity."""
    by_stage = {s["stage"]: s for s in stages}
    measured_of = {
        "wall": lambda s: s["wall_s"],
        "gpu_hours": lambda s: round(s["gpu_s"] / 3600, 4),
        "disk": lambda s: s["disk_bytes"],
        "start": lambda s: s.get("start_s"),
        "per_token": lambda s: s.get("per_token_s"),
    }
    out = []
    for entry in forecast["stages"]:
        stage = by_stage.get(entry["stage"])
        measured = measured_of[entry["quantity"]](stage) if stage and stage.get("wall_s") is not None else None
        row = dict(entry, measured=measured)
        if measured:
            row["ratio"] = round(entry["forecast"] / measured, 3)
            row["within_25pct"] = abs(entry["forecast"] - measured) <= TOLERANCE * measured
        out.append(row)
    return {"costs": costs_note, "tolerance": TOLERANCE, "stages": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="the run folder (results tarball unpacked)")
    parser.add_argument("--run-root", default=None, help="the run folder's path on the machine (du's paths)")
    parser.add_argument("--stage-peaks", type=Path, required=True)
    parser.add_argument("--du", type=Path, action="append", required=True, help="du -ab snapshot(s); repeatable")
    parser.add_argument("--forecast", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--out-stages", type=Path, required=True)
    parser.add_argument("--out-forecast", type=Path, required=True)
    args = parser.parse_args()
    run_root = args.run_root or f"/root/work/results/{args.run.name}"
    artefacts: dict[str, Any] = {}
    replica = args.run / "hidden_states" / "replica_0.json"
    if replica.is_file():
        artefacts["replica"] = json.loads(replica.read_text())
    metrics = sorted((args.run / "train_work" / "logs").glob("metrics-attempt-*.jsonl"))
    if metrics:
        rows = [json.loads(line) for line in metrics[-1].read_text().splitlines() if line.strip()]
        artefacts["training_split"] = training_split(rows)
    peaks = json.loads(args.stage_peaks.read_text())
    peaks = peaks["stages"] if isinstance(peaks, dict) else peaks
    stages = measured_stages(
        peaks, du_sizes_largest([du.read_text() for du in args.du], run_root), artefacts, args.gpus
    )
    forecast = json.loads(args.forecast.read_text())
    args.out_stages.write_text(json.dumps({"gpus": args.gpus, "stages": stages}, indent=1) + "\n")
    result = compare(forecast, stages, forecast.get("machine", ""))
    args.out_forecast.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["stages"]:
        verdict = {True: "within 25%", False: "MISSED", None: "-"}[row.get("within_25pct")]
        print(f"{row['stage']:24s} {row['quantity']:10s} forecast {row['forecast']:>14} measured {row['measured']!s:>14}"
              f" {row['unit']:6s} {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
