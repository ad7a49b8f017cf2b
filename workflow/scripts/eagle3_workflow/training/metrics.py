"""metrics.csv from the trainer's metric records.

speculators' metric logger records {"train": {...}, "profile": {...}, "epoch", "lr", "global_step"} per logged train
step and {"val": {..._epoch}, "epoch"} per validation epoch; the trainer entry writes each as a JSON line
{"step": ..., "metrics": <that dict>}, one file per launch (workdir.attempt_files). Pure: pandas only, imported where
a table is built.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.training.workdir import attempt_files

log = logging.getLogger("eagle3.training")


def read_metric_lines(path: Path) -> list[dict[str, Any]]:
    """The records of one attempt's metrics JSONL ([] when the attempt logged none). A kill can cut the last
    line short: an unreadable line is skipped with a warning."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            log.warning("skipping line %d of %s (cut short by a kill?): %r", number, path, exc)
    return records


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"loss": 1}} -> {"train/loss": 1}, as speculators' logger backends name the values."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}/")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _metric_column(key: str) -> str:
    for prefix in ("train/", "val/", "profile/"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key.endswith("_epoch"):
        key = key[: -len("_epoch")]
    return key.replace("/", "_")


def _column_order(columns: Iterable[str]) -> list[str]:
    head = ["attempt", "split", "epoch", "global_step", "loss"]

    def per_position(prefix: str) -> list[str]:
        found = [c for c in columns if re.fullmatch(rf"{prefix}_\d+", c)]
        return sorted(found, key=lambda c: int(c.rsplit("_", 1)[1]))

    ordered = [c for c in head if c in columns]
    for prefix in ("loss", "full_acc", "cond_acc"):
        ordered += per_position(prefix)
    ordered += sorted(c for c in columns if c.startswith("lr"))
    ordered += sorted(c for c in columns if c not in ordered)
    return ordered


def metric_row(attempt: int, record: dict[str, Any]) -> dict[str, Any] | None:
    """One metrics.csv row for a JSONL record, or None for a record that is neither a train step nor a
    validation epoch. A validation row's global_step is the record's step: the optimizer steps done when it ran."""
    flat = _flatten(record.get("metrics") or {})
    if any(k.startswith("train/") for k in flat) and "global_step" in flat:
        split, step = "train", flat["global_step"]
    elif any(k.startswith("val/") for k in flat) and "epoch" in flat:
        split, step = "val", record.get("step")
    else:
        return None
    row: dict[str, Any] = {"attempt": attempt, "split": split, "epoch": flat.get("epoch"), "global_step": step}
    for key, value in flat.items():
        if key in ("epoch", "global_step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key == "lr" or key.startswith(("lr/", "train/", "val/", "profile/")):
            row[_metric_column(key)] = float(value)
    return row


def metrics_table(attempts: Sequence[Sequence[dict[str, Any]]]):
    """One row per logged train step and per validation epoch, from each attempt's metric records, in order.

    Columns: attempt, split (train|val), epoch, global_step, loss, loss_<k>, full_acc_<k>, cond_acc_<k> (k = draft
    position, i.e. TTT step), lr, then the rest (error_records, profile timings). A rerun that resumed from a
    checkpoint repeats the steps after it: the last attempt's rows win, so the table follows the run that
    produced the final weights.
    """
    import pandas as pd

    rows = [
        row
        for attempt, records in enumerate(attempts, start=1)
        for record in records
        if (row := metric_row(attempt, record)) is not None
    ]
    if not rows:
        return pd.DataFrame(columns=["attempt", "split", "epoch", "global_step", "loss"])
    frame = pd.DataFrame(rows)
    frame["global_step"] = frame["global_step"].astype("Int64")
    frame["epoch"] = frame["epoch"].astype("Int64")
    train = frame[frame["split"] == "train"].drop_duplicates("global_step", keep="last")
    val = frame[frame["split"] == "val"].drop_duplicates("epoch", keep="last")
    frame = pd.concat([train, val]).sort_values(["epoch", "global_step", "split"], kind="stable")
    return frame[_column_order(frame.columns)].reset_index(drop=True)


def attempt_metrics(logs_dir: Path) -> list[list[dict[str, Any]]]:
    """The metric records of every launch so far, in order (an attempt killed before its first step has none)."""
    launches = len(list(logs_dir.glob("trainer-attempt-*.log")))
    return [read_metric_lines(attempt_files(logs_dir, n)[1]) for n in range(1, launches + 1)]


def _last(frame, split: str, column: str) -> float | None:
    rows = frame[frame["split"] == split]
    if column not in rows or rows[column].dropna().empty:
        return None
    return float(rows[column].dropna().iloc[-1])


def final_metrics(metrics, logs_dir: Path) -> tuple[float, float | None, list[float]]:
    """(last train loss, last validation loss, last validation's full accuracy per draft position), or StageError
    when the trainer logged no train step or its loss diverged."""
    train_rows = metrics[metrics["split"] == "train"]
    if train_rows.empty:
        raise StageError(
            f"no training metrics in {logs_dir}/metrics-attempt-*.jsonl: speculators logged no train step on its "
            f"'speculators.metrics' logger (did that logger or setup_metric_logger change? run check_api)"
        )
    final_loss = _last(metrics, "train", "loss")
    if final_loss is None or not math.isfinite(final_loss):
        raise StageError(f"the final training loss is {final_loss}; training diverged (see {logs_dir})")
    val_rows = metrics[metrics["split"] == "val"]
    full_acc = []
    if not val_rows.empty:
        last_val = val_rows.iloc[-1]
        full_acc = [float(last_val[c]) for c in metrics.columns if re.fullmatch(r"full_acc_\d+", c)]
    return final_loss, _last(metrics, "val", "loss"), full_acc
