"""Online against offline training, side by side on one GPU, on a finished run's data: train_draft (the stage
function, as the rule runs it) for --epochs epochs on the first --rows prepared rows, once reading the run's
hidden-state files (offline), once generating every sample from its own vLLM server on the trainer's GPU
(online, train.online.server_gpus: 0). Same config, data, seed and flags otherwise.

usage: python bench/gpu/online_vs_offline_gpu.py RUN_DIR [--rows 2000] [--epochs 1] [--server-memory 0.35]
                                                 [--requests-in-flight 1 [N ...]] [--num-workers W]
                                                 [--work DIR] [--out FILE.json] [--online-first]

RUN_DIR: results/<run> of a run that got through validate_hidden_states (its provenance.json holds the resolved
config). Per mode: the stage's wall time, the trainer's time (wall minus the online server's start), steps and
steps/s, the median of speculators' per-step profile (step_ms, fetch_ms: the time a step waited for data), and the
disk: offline the bytes of the rows' hidden-state files (on disk for the whole run) plus train_work's high-water
mark; online the high-water mark of the server's output folder plus train_work's. Ratios are online / offline.
Also runs on CPU (a finished tiny run) to try it out.

Online runs once at the config's train.online.requests_in_flight (mode ``online``, folder ``online/``) and once more
at each other value of --requests-in-flight (mode ``online-rif<N>``, run after it; 1 = speculators' own serial
fetch, one request per DataLoader worker): ``by_requests_in_flight`` holds each one's steps/s against offline's.
--num-workers overrides train.num_workers for every mode. With EAGLE3_PROBE_REQUESTS_IN_FLIGHT=<dir> and
EAGLE3_PROBE_REQUESTS_IN_FLIGHT_NO_WAIT=1 in the environment and tests/fault_plugins on PYTHONPATH, each online
mode also reports the requests its trainer processes had in flight at once (``in_flight``: the probe's files).
--out is written before each mode too (``finished``: false): a call cut inside a later mode keeps the finished
ones. Offline runs first; --online-first runs the configured online mode before it (on a machine whose kernel
cache is cold, the first run's compilation then slows online, not offline: the ratio errs against online).
Rates: ``steps_per_s`` is steps over the trainer's wall (imports, compilation and validation included: at a few
dozen steps mostly fixed costs), ``steady_steps_per_s`` over the trainer's own step times after the first 5 steps
(each step's wait for data included): the rate a longer run settles at.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "workflow" / "scripts"), str(REPO / "bench" / "online"), str(REPO / "bench" / "gpu")]

from bench_gpu import SKIP_STEPS, steady_steps, steps_per_s  # noqa: E402
from online_vs_offline import HighWater, emit, online_over_offline  # noqa: E402

from eagle3_workflow.files.artefacts import load  # noqa: E402
from eagle3_workflow.files.draft_artefacts import Provenance  # noqa: E402
from eagle3_workflow.files.hidden_states import hs_file  # noqa: E402
from eagle3_workflow.files.target_artefacts import ApiCompatReport  # noqa: E402
from eagle3_workflow.files.writing import write_text_atomic  # noqa: E402
from eagle3_workflow.settings.schema import validate_config  # noqa: E402
from eagle3_workflow.settings.sections import TrainSettings  # noqa: E402
from eagle3_workflow.settings.stages import TrainDraftOnlineStage  # noqa: E402
from eagle3_workflow.settings.views import SCHEMA_PATH, view_of  # noqa: E402
from eagle3_workflow.training.stage import online_serving, train_draft  # noqa: E402


def subset(prepared: Path, rows: int, out: Path) -> int:
    import datasets

    data = datasets.load_from_disk(str(prepared))
    rows = min(rows, len(data))
    if out.exists():
        shutil.rmtree(out)
    data.select(range(rows)).save_to_disk(str(out))
    return rows


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v == v)  # NaN: a column absent in some rows
    return values[len(values) // 2] if values else None


def steady_steps_per_s(step_ms: list[float], skip: int = SKIP_STEPS) -> float | None:
    """Steps per second over the logged steps after the first `skip` (the trainer's own step_ms, which holds the
    step's wait for data), as the training pairs measure a run: the rate a longer run settles at, without the fixed
    costs (imports, compilation, validation) that a wall-clock rate of a few dozen steps is mostly made of. None
    under 3 steady steps."""
    try:
        return round(steps_per_s(steady_steps([ms for ms in step_ms if ms == ms], skip)), 3)  # NaN: no column
    except ValueError:
        return None


def profile(draft: Path) -> dict:
    import pandas as pd

    metrics = pd.read_csv(draft / "metrics.csv")
    train = metrics[metrics["split"] == "train"]
    found = {}
    for column in ("profile/step_ms", "profile/fetch_ms", "profile/tokens_per_s", "step_ms", "fetch_ms"):
        if column in train.columns:
            found[column.split("/")[-1] + "_median"] = median(list(train[column].astype(float))[3:])
    for column in ("profile/step_ms", "step_ms"):
        if column in train.columns:
            found["steady_steps_per_s"] = steady_steps_per_s(list(train[column].astype(float)))
            break
    return found


def run_mode(mode: str, config: dict, inputs: dict, work: Path) -> dict:
    folder = work / mode
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    api = load(ApiCompatReport, inputs["api_compat"])
    watch = HighWater(folder / "train_work", interval_s=0.5)
    watch.start()
    started = time.monotonic()
    if mode == "offline":
        settings = view_of(TrainSettings, config["train"])
        summary = train_draft(settings, **inputs, work_dir=folder / "train_work", out_dir=folder / "draft",
                              trust_remote_code=config["target"]["trust_remote_code"])  # fmt: skip
    else:
        stage = view_of(TrainDraftOnlineStage, config)
        serving = online_serving(stage, api, str(inputs["target"]))
        summary = train_draft(stage.train, **inputs, work_dir=folder / "train_work", out_dir=folder / "draft",
                              trust_remote_code=config["target"]["trust_remote_code"], online=serving)  # fmt: skip
    wall = time.monotonic() - started
    work_peak = watch.stop()
    startup = summary.online.server_ready_s if summary.online else 0.0
    row = {
        "mode": mode,
        "wall_s": round(wall, 1),
        "server_start_s": startup,
        "trainer_s": round(wall - startup, 1),
        "steps": summary.steps,
        "steps_per_s": round(summary.steps / (wall - startup), 3),
        "train_work_peak_bytes": work_peak,
        "final_val_loss": summary.final_val_loss,
        "final_val_full_acc": summary.final_val_full_acc,
        **profile(folder / "draft"),
    }
    if summary.online is not None:
        row["requests_in_flight"] = config["train"]["online"]["requests_in_flight"]
        row["online"] = summary.online.model_dump()
        row["hidden_states_peak_bytes"] = summary.online.peak_bytes
        row["in_flight"] = in_flight(folder.name)
    return row


def in_flight(mode: str) -> list[dict]:
    """What the in-flight probe (tests/fault_plugins) recorded for this mode's trainer processes: the peak, and
    the mean in flight while at least one request was (summed request seconds / busy seconds). Moved into a
    folder of the mode's own, so that the next mode starts from none."""
    import json
    import os

    probe = os.environ.get("EAGLE3_PROBE_REQUESTS_IN_FLIGHT")
    if not probe:
        return []
    found = []
    for path in sorted(Path(probe).glob("in-flight-*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        busy = record["busy_s"]
        found.append({**record, "mean_in_flight_while_busy": round(record["request_s"] / busy, 2) if busy else None})
        path.rename(path.with_name(f"{mode}-{path.name}"))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--server-memory", type=float, default=0.35)
    parser.add_argument("--requests-in-flight", type=int, nargs="+", default=[1])
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/online_vs_offline"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--online-first", action="store_true")
    args = parser.parse_args()
    run = args.run_dir.resolve()
    config = load(Provenance, run / "provenance.json").config
    config["train"] = {**config["train"], "epochs": args.epochs}
    validate_config(config, SCHEMA_PATH)  # a run made before train.online existed gets the schema's defaults
    config["train"]["online"] |= {"server_gpus": 0, "gpu_memory_utilization": args.server_memory}
    if args.num_workers is not None:
        config["train"]["num_workers"] = args.num_workers
    validate_config(config, SCHEMA_PATH)
    configured = config["train"]["online"]["requests_in_flight"]
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = subset(run / "data" / "prepared", args.rows, work / "prepared")
    api = load(ApiCompatReport, run / "checks" / "api_compat.json")
    inputs = {
        "target": Path(api.target.path) if Path(api.target.path).is_absolute() else run.parent.parent / api.target.path,
        "prepared": work / "prepared",
        "token_freq": run / "data" / "token_freq.pt",
        "api_compat": run / "checks" / "api_compat.json",
        "validation": run / "hidden_states" / "validation.json",
        "files_dir": run / "hidden_states" / "files",
    }
    files_bytes = sum(hs_file(inputs["files_dir"], row).stat().st_size for row in range(rows))
    head = {"run_dir": str(run), "rows": rows, "epochs": args.epochs, "num_workers": config["train"]["num_workers"],
            "online_first": args.online_first}  # fmt: skip
    offline, online_modes = None, []
    for count in mode_plan(configured, args.requests_in_flight, args.online_first):
        # the report so far on disk before each mode: a call cut inside a later mode keeps the finished ones
        write_partial(report_of(head, offline, online_modes, configured, finished=False), args.out)
        if count is None:
            offline = run_mode(
                "offline", {**config, "train": {**config["train"], "hidden_states": "offline"}}, inputs, work
            )
            offline["hidden_states_peak_bytes"] = files_bytes
            continue
        train = {**config["train"], "hidden_states": "online"}
        train["online"] = {**train["online"], "requests_in_flight": count}
        mode = "online" if count == configured else f"online-rif{count}"
        online_modes.append(run_mode(mode, {**config, "train": train}, inputs, work))
    emit(report_of(head, offline, online_modes, configured, finished=True), args.out)


def mode_order(configured: int, others: list[int]) -> list[int]:
    """The requests-in-flight counts to run online at: the configured one first (the figure the goal is about), then
    each other one asked for, once."""
    return [configured, *(n for n in dict.fromkeys(others) if n != configured)]


RATE_KEYS = ("steps_per_s", "steady_steps_per_s", "trainer_s")


def mode_plan(configured: int, others: list[int], online_first: bool = False) -> list[int | None]:
    """The order the modes run in: None for offline, a requests-in-flight count for online. Offline first by
    default (a cut call keeps a ratio for each online mode that finished); with online_first the configured online
    mode runs before offline, so that the process tree's cold kernel compilation (on a fresh machine, the first
    training run's steady steps were 13% slower: 2026-12-07-llama8b-shape-pairs) falls on online's side and the
    ratio errs against online, never for it."""
    counts = mode_order(configured, others)
    return [counts[0], None, *counts[1:]] if online_first else [None, *counts]


def report_of(head: dict, offline: dict | None, online_modes: list[dict], configured: int, finished: bool) -> dict:
    """The report from the modes run so far: online / offline at the configured count and at each count that ran,
    once offline ran too. `finished` is false while modes are still to run (a cut call's file says so)."""
    ran = [row for row in (offline, *online_modes) if row is not None]
    for row in ran:
        row["peak_disk_bytes"] = row["hidden_states_peak_bytes"] + row["train_work_peak_bytes"]
    at_configured = [row for row in online_modes if row["requests_in_flight"] == configured]
    keys = ("wall_s", "trainer_s", "steps_per_s", "steady_steps_per_s", "peak_disk_bytes", "hidden_states_peak_bytes")
    ratios = online_over_offline(offline, at_configured[0], keys) if at_configured and offline else {}
    by_count = {str(row["requests_in_flight"]): online_over_offline(offline, row, RATE_KEYS)
                for row in online_modes if offline}  # fmt: skip
    return {**head, "finished": finished, "modes": ran, "online_over_offline": ratios,
            "by_requests_in_flight": by_count}  # fmt: skip


def write_partial(report: dict, out: Path | None) -> None:
    """The report so far into `out` (not on stdout, where only the finished one goes), atomically: a call cut while
    writing leaves the previous report, never a torn file."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
