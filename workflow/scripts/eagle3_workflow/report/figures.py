"""The report's figures (SVG through matplotlib's Agg backend): data, extraction, training curves, acceptance.

Tolerant of what a run may lack: a missing piece (no training metrics, unfamiliar columns) becomes a note drawn in
the figure rather than an error. matplotlib, numpy and pandas are imported inside the functions that draw.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.data_artefacts import DataManifest, ExtractionManifest
from eagle3_workflow.files.draft_artefacts import AcceptanceReport

log = logging.getLogger("eagle3.report")

TRAINED_COLOUR = "#1f77b4"
UNTRAINED_COLOUR = "#bbbbbb"
BASELINE_COLOUR = "#555555"
STEP_COLUMNS = ("global_step", "step", "iteration", "iter", "epoch")
SPLIT_COLUMNS = ("split", "phase", "stage", "mode")


def _figure(ncols: int, width: float = 11.0, height: float = 4.0) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["axes.titlesize"] = 10  # titles carry numbers; the default size clips them
    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, axes[0]


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # svg metadata carries a date by default; drop it so the same artefacts give the same figure
    fig.savefig(path, format=path.suffix.lstrip(".") or "svg", metadata={"Date": None})
    plt.close(fig)


def _message(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes, color="#555555")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_data(manifest: DataManifest, path: Path) -> None:
    fig, (counts_ax, lengths_ax) = _figure(2)
    dropped = manifest.dropped
    labels = ["kept"] + [f"dropped: {k}" for k in dropped]
    values = [manifest.records_kept] + list(dropped.values())
    counts_ax.barh(labels[::-1], values[::-1], color=[BASELINE_COLOUR] * len(dropped) + [TRAINED_COLOUR])
    counts_ax.set_xlabel("records")
    counts_ax.set_title(f"{manifest.records_read} records read, {manifest.truncated} truncated")
    percentiles = manifest.length_percentiles
    if percentiles:
        names = list(percentiles)
        lengths_ax.bar(names, [percentiles[n] for n in names], color=TRAINED_COLOUR)
        lengths_ax.set_ylabel("tokens per sample")
        lengths_ax.set_title(
            f"{manifest.total_tokens:,} tokens, {manifest.assistant_tokens:,} trained on "
            f"(max_seq_len {manifest.max_seq_len})"
        )
    else:
        _message(lengths_ax, "no length statistics in data/manifest.json")
    _save(fig, path)


def plot_extraction(manifests: Sequence[ExtractionManifest], path: Path) -> None:
    fig, (speed_ax, samples_ax) = _figure(2)
    if not manifests:
        _message(speed_ax, "no extraction manifests")
        _message(samples_ax, "")
        _save(fig, path)
        return
    names = [f"replica {m.replica}" for m in manifests]
    speed_ax.bar(names, [m.tokens_per_s for m in manifests], color=TRAINED_COLOUR)
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_title("extraction throughput")
    extracted = [m.samples_extracted for m in manifests]
    reused = [m.samples_reused for m in manifests]
    samples_ax.bar(names, extracted, label="extracted", color=TRAINED_COLOUR)
    samples_ax.bar(names, reused, bottom=extracted, label="reused (resume)", color=UNTRAINED_COLOUR)
    samples_ax.set_ylabel("samples")
    samples_ax.set_title("samples per replica")
    samples_ax.legend()
    _save(fig, path)


def read_training_metrics(path: Path) -> Any | None:
    """draft/metrics.csv as a DataFrame, or None. Any step/epoch column, loss and accuracy columns."""
    import pandas as pd

    if not path.exists():
        return None
    try:
        frame = pd.read_csv(path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        log.warning("cannot read %s: %r", path, exc)
        return None
    return frame if len(frame) else None


def _natural_key(name: str) -> tuple[str, int]:
    match = re.match(r"(.*?)(\d+)$", name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


def _numeric_columns(frame: Any) -> list[str]:
    import pandas as pd

    return [c for c in frame.columns if pd.api.types.is_numeric_dtype(frame[c])]


def plot_training(frame: Any | None, path: Path, *, source: str) -> None:
    """Loss and per-position accuracy against the step; train and validation rows apart when a split column
    says which is which. Tolerant: any missing piece becomes a note in the figure."""
    fig, (loss_ax, acc_ax) = _figure(2)
    if frame is None:
        _message(loss_ax, f"no training metrics ({source} missing or empty)")
        _message(acc_ax, "")
        _save(fig, path)
        return
    numeric = _numeric_columns(frame)
    x_column = next((c for c in STEP_COLUMNS if c in numeric and frame[c].notna().any()), None)
    split_column = next((c for c in SPLIT_COLUMNS if c in frame.columns and c not in numeric), None)
    groups = list(frame.groupby(split_column, sort=True)) if split_column else [("", frame)]
    loss_columns = ["loss"] if "loss" in numeric else sorted((c for c in numeric if "loss" in c), key=_natural_key)
    acc_columns = sorted((c for c in numeric if "acc" in c), key=_natural_key)
    # per-position accuracy: prefer the full (all earlier positions right) accuracy when there is one
    full_acc = [c for c in acc_columns if c.startswith("full_acc")]
    acc_columns = full_acc or acc_columns

    def draw(ax: Any, columns: list[str], ylabel: str) -> None:
        # one colour per column, one line style per split (train solid, validation dashed)
        drawn = False
        for split_index, (split, rows) in enumerate(groups):
            xs = rows[x_column] if x_column else rows.index
            for column_index, column in enumerate(columns):
                values = rows[column]
                mask = values.notna()
                if not mask.any():
                    continue
                label = f"{split} {column}".strip()
                marker = "o" if mask.sum() < 20 else ""
                ax.plot(
                    xs[mask],
                    values[mask],
                    marker=marker,
                    linestyle="-" if split_index == 0 else "--",
                    color=f"C{column_index % 10}",
                    label=label,
                    markersize=4,
                    linewidth=1.2,
                )
                drawn = True
        if drawn:
            ax.set_xlabel(x_column or "row")
            ax.set_ylabel(ylabel)
            ax.legend(fontsize=7)
        else:
            _message(ax, f"no {ylabel} columns in {source}")

    draw(loss_ax, loss_columns, "loss")
    loss_ax.set_title("training loss")
    draw(acc_ax, acc_columns, "accuracy")
    acc_ax.set_title("per-position accuracy")
    _save(fig, path)


def plot_acceptance(report: AcceptanceReport, path: Path) -> None:
    import numpy as np

    fig, (position_ax, speed_ax) = _figure(2)
    k = report.num_speculative_tokens
    positions = np.arange(1, k + 1)
    width = 0.38
    for offset, result, colour in (
        (-width / 2, report.trained, TRAINED_COLOUR),
        (width / 2, report.untrained, UNTRAINED_COLOUR),
    ):
        rates = (list(result.per_position_acceptance) + [0.0] * k)[:k]
        position_ax.bar(
            positions + offset,
            rates,
            width,
            color=colour,
            label=f"{result.label}: acceptance length {result.mean_acceptance_length:.2f}",
        )
    position_ax.set_xticks(positions)
    position_ax.set_xlabel("draft position")
    position_ax.set_ylabel("accepted / drafts")
    position_ax.set_ylim(0, 1)
    position_ax.set_title(f"per-position acceptance ({report.num_prompts} {report.prompt_source} prompts)")
    position_ax.legend(fontsize=8)

    # a draft without a timing pass (evaluate.time_untrained false) gets no bar, not a bar of 0 tokens/s
    timed = [(report.trained, TRAINED_COLOUR), (report.untrained, UNTRAINED_COLOUR)]
    timed = [(r, colour) for r, colour in timed if r.throughput]
    names = ["no speculation", *(r.label for r, _ in timed)]
    speeds = [report.no_speculation_tokens_per_s, *(r.tokens_per_s for r, _ in timed)]
    bars = speed_ax.bar(names, speeds, color=[BASELINE_COLOUR, *(colour for _, colour in timed)])
    for bar, ratio in zip(bars, [1.0, *(r.speedup for r, _ in timed)], strict=True):
        speed_ax.annotate(
            f"x{ratio:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9
        )
    speed_ax.set_ylabel("generated tokens / s")
    level = report.no_speculation_throughput[0].concurrency if report.no_speculation_throughput else "?"
    speed_ax.set_title(f"tokens/s on {report.device} at concurrency {level} (greedy, max_tokens {report.max_tokens})")
    _save(fig, path)
