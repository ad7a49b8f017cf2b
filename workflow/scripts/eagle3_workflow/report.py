"""Rules `summarize_run` and `report`: the run's figures and tables, bundled as a real Snakemake report.

How report.html is made (and why). The goal is Snakemake's own report (figures with captions, the rule graph,
runtimes, the code of every rule), and also `report.html` as an output of rule `report`, so `snakemake` alone
makes it and `rule all` can ask for it. Two rules do that:

- `summarize_run` reads the artefacts and writes figures (SVG) and tables (small HTML pages) under
  ``results/<run>/report/``, each flagged with ``report(..., caption=..., category=...)`` (captions in
  ``workflow/report/``). ``snakemake --report`` run by hand on the same config therefore also works.
- `report` runs ``python -m snakemake -s <Snakefile> --configfile <resolved config> --nolock --report
  results/<run>/report.html`` on this same workflow, in its working directory.

Why two rules: Snakemake marks the outputs of a running job incomplete, and ``--report`` refuses incomplete
files (``create_report`` has no ``--ignore-incomplete``); when `report` runs, `summarize_run` has finished.
``--nolock`` because the outer Snakemake holds the working directory's lock (a report only reads). The nested
call gets the outer run's resolved config (every default filled, every ``--config`` override applied), so it
builds the same DAG. Tested end to end in tests/test_report.py.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.contracts import AcceptanceReport, read_json, write_json_atomic
from eagle3_workflow.errors import StageError

log = logging.getLogger("eagle3.report")

TRAINED_COLOUR = "#1f77b4"
UNTRAINED_COLOUR = "#bbbbbb"
BASELINE_COLOUR = "#555555"
STEP_COLUMNS = ("global_step", "step", "iteration", "iter", "epoch")
SPLIT_COLUMNS = ("split", "phase", "stage", "mode")

PAGE_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; font-size: 14px; margin: 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.fail { color: #b00020; font-weight: bold; }
.pass { color: #1b5e20; }
pre { background: #f7f7f7; padding: 0.5em; overflow-x: auto; font-size: 12px; }
"""


@dataclasses.dataclass
class ReportInputs:
    provenance: Path
    manifest: Path
    api_compat: Path
    canary: Path
    extraction: list[Path]
    validation: Path
    draft: Path
    acceptance: Path


@dataclasses.dataclass
class ReportOutputs:
    summary: Path
    data: Path
    data_table: Path
    gates: Path
    extraction: Path
    extraction_table: Path
    training: Path
    acceptance: Path
    acceptance_table: Path
    provenance: Path


# ----------------------------------------------------------------------------------------------------------------
# HTML helpers


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return f'<td class="{"pass" if value else "fail"}">{"PASS" if value else "FAIL"}</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:,.4g}</td>'
    if isinstance(value, int):
        return f'<td class="num">{value:,}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def key_value_table(pairs: Sequence[tuple[str, Any]]) -> str:
    return html_table(["", ""], pairs)


def html_page(title: str, sections: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<h3>{html.escape(heading)}</h3>{content}" for heading, content in sections)
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{PAGE_STYLE}</style></head><body><h2>{html.escape(title)}</h2>{body}</body></html>\n"
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------------------------
# Figures


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


def plot_data(manifest: dict[str, Any], path: Path) -> None:
    fig, (counts_ax, lengths_ax) = _figure(2)
    dropped = manifest.get("dropped") or {}
    labels = ["kept"] + [f"dropped: {k}" for k in dropped]
    values = [manifest.get("records_kept", 0)] + list(dropped.values())
    counts_ax.barh(labels[::-1], values[::-1], color=[BASELINE_COLOUR] * len(dropped) + [TRAINED_COLOUR])
    counts_ax.set_xlabel("records")
    counts_ax.set_title(f"{manifest.get('records_read', '?')} records read, {manifest.get('truncated', 0)} truncated")
    percentiles = manifest.get("length_percentiles") or {}
    if percentiles:
        names = list(percentiles)
        lengths_ax.bar(names, [percentiles[n] for n in names], color=TRAINED_COLOUR)
        lengths_ax.set_ylabel("tokens per sample")
        lengths_ax.set_title(
            f"{manifest.get('total_tokens', 0):,} tokens, {manifest.get('assistant_tokens', 0):,} trained on "
            f"(max_seq_len {manifest.get('max_seq_len', '?')})"
        )
    else:
        _message(lengths_ax, "no length statistics in data/manifest.json")
    _save(fig, path)


def plot_extraction(manifests: Sequence[dict[str, Any]], path: Path) -> None:
    fig, (speed_ax, samples_ax) = _figure(2)
    if not manifests:
        _message(speed_ax, "no extraction manifests")
        _message(samples_ax, "")
        _save(fig, path)
        return
    names = [f"replica {m.get('replica', i)}" for i, m in enumerate(manifests)]
    speed_ax.bar(names, [m.get("tokens_per_s", 0.0) for m in manifests], color=TRAINED_COLOUR)
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_title("extraction throughput")
    extracted = [m.get("samples_extracted", 0) for m in manifests]
    reused = [m.get("samples_reused", 0) for m in manifests]
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

    names = ["no speculation", report.trained.label, report.untrained.label]
    speeds = [report.no_speculation_tokens_per_s, report.trained.tokens_per_s, report.untrained.tokens_per_s]
    bars = speed_ax.bar(names, speeds, color=[BASELINE_COLOUR, TRAINED_COLOUR, UNTRAINED_COLOUR])
    for bar, ratio in zip(bars, [1.0, report.trained.speedup, report.untrained.speedup], strict=True):
        speed_ax.annotate(
            f"x{ratio:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9
        )
    speed_ax.set_ylabel("generated tokens / s")
    speed_ax.set_title(f"throughput on {report.device} (greedy, max_tokens {report.max_tokens})")
    _save(fig, path)


# ----------------------------------------------------------------------------------------------------------------
# Tables


def data_page(manifest: dict[str, Any]) -> str:
    scalars = [
        (key, value) for key, value in manifest.items() if not isinstance(value, dict | list) and value is not None
    ]
    sections = [("Counts", key_value_table(scalars))]
    if manifest.get("dropped"):
        sections.append(
            ("Dropped records by reason", html_table(["reason", "records"], list(manifest["dropped"].items())))
        )
    if manifest.get("length_percentiles"):
        sections.append(("Sequence length (tokens)", key_value_table(list(manifest["length_percentiles"].items()))))
    if manifest.get("sources"):
        sections.append(("Sources", html_table(["path"], [[s] for s in manifest["sources"]])))
    return html_page("Prepared data (data/manifest.json)", sections)


def _checks(report: dict[str, Any]) -> str:
    rows = [
        (c.get("name", ""), c.get("expected", ""), c.get("found", ""), bool(c.get("passed")), c.get("detail", ""))
        for c in report.get("checks") or []
    ]
    return html_table(["check", "expected", "found", "pass", "detail"], rows) if rows else "<p>no checks recorded</p>"


def gates_page(api_compat: dict[str, Any], canary: dict[str, Any], validation: dict[str, Any]) -> str:
    versions = [(k, api_compat[k]) for k in api_compat if k.endswith("_version") or k in ("device", "layer_ids")]
    canary_errors = [
        (
            layer,
            canary.get("per_layer_max_rel_error", {}).get(layer),
            (canary.get("per_layer_mean_rel_error") or {}).get(layer),
        )
        for layer in canary.get("per_layer_max_rel_error") or {}
    ]
    validation_rows = [
        (k, v if not isinstance(v, list | dict) else (len(v) if k != "files_dir" else ", ".join(map(str, v))))
        for k, v in validation.items()
    ]
    return html_page(
        "Gates",
        [
            (
                f"check_api: {'PASS' if api_compat.get('passed') else 'FAIL'}",
                key_value_table(versions) + _checks(api_compat),
            ),
            (
                f"canary: {'PASS' if canary.get('passed') else 'FAIL'} ({canary.get('canary_layers', '?')} layers vs "
                f"{canary.get('reference', 'reference')}, tolerance {canary.get('tolerance', '?')})",
                html_table(["layer id", "max relative error", "mean relative error"], canary_errors) + _checks(canary),
            ),
            ("validate_hidden_states", key_value_table(validation_rows)),
        ],
    )


def extraction_page(manifests: Sequence[dict[str, Any]]) -> str:
    columns = [
        "replica",
        "samples_total",
        "samples_extracted",
        "samples_reused",
        "tokens",
        "bytes_written",
        "wall_s",
        "server_ready_s",
        "tokens_per_s",
    ]
    rows = [[m.get(c, "") for c in columns] for m in manifests]
    total_tokens = sum(int(m.get("tokens", 0) or 0) for m in manifests)
    total_wall = max((float(m.get("wall_s", 0) or 0) for m in manifests), default=0.0)
    totals = key_value_table(
        [
            ("replicas", len(manifests)),
            ("tokens", total_tokens),
            ("slowest replica wall s", total_wall),
            ("aggregate tokens / s", total_tokens / total_wall if total_wall else 0.0),
        ]
    )
    return html_page("Hidden-state extraction", [("Per replica", html_table(columns, rows)), ("Total", totals)])


def acceptance_page(report: AcceptanceReport) -> str:
    k = report.num_speculative_tokens
    headers = ["run", "mean acceptance length", "draft acceptance rate"] + [f"pos {i + 1}" for i in range(k)]
    headers += ["drafts", "accepted", "tokens", "seconds", "tokens / s", "speedup", "engine start s", "lossless"]
    rows = [
        ["no speculation", "", ""]
        + [""] * k
        + [
            "",
            "",
            report.no_speculation_generated_tokens,
            report.no_speculation_generate_s,
            report.no_speculation_tokens_per_s,
            1.0,
            report.no_speculation_engine_start_s,
            "",
        ]
    ]
    for r in (report.trained, report.untrained):
        rows.append(
            [r.label, r.mean_acceptance_length, r.draft_acceptance_rate]
            + [float(x) for x in (list(r.per_position_acceptance) + [0.0] * k)[:k]]
            + [
                r.num_drafts,
                r.accepted_tokens,
                r.generated_tokens,
                r.generate_s,
                r.tokens_per_s,
                r.speedup,
                r.engine_start_s,
                r.lossless,
            ]
        )
    setup = key_value_table(
        [
            ("prompts", f"{report.num_prompts} of {report.num_prompts_requested} requested ({report.prompt_source})"),
            ("prompt detail", report.prompt_detail),
            ("num_speculative_tokens", report.num_speculative_tokens),
            ("max_tokens", report.max_tokens),
            ("device", report.device),
            ("vLLM", report.vllm_version),
            ("lossless", report.lossless),
            ("lossless mismatches (incl. tolerated)", report.lossless_mismatches),
            ("untrained baseline", report.untrained_baseline),
        ]
    )
    processes = html_table(
        ["engines", "process wall s", "vLLM import s", "engine start s", "host load (1 min)"],
        [
            [", ".join(p.runs), p.wall_s, p.vllm_import_s, json.dumps(p.engine_start_s), p.load_1m]
            for p in report.processes
        ],
    )
    sections = [("Results", html_table(headers, rows)), ("Setup", setup), ("Measurement processes", processes)]
    mismatches = [
        (
            r.label,
            m.prompt_index,
            m.origin,
            m.position,
            m.expected_text,
            m.found_text,
            "-" if m.logprob_gap is None else m.logprob_gap,
            m.tolerated,
        )
        for r in (report.trained, report.untrained)
        for m in r.mismatches
    ]
    if mismatches:
        sections.append(
            (
                "Greedy divergences",
                html_table(["draft", "prompt", "origin", "token", "expected", "found", "gap", "tolerated"], mismatches),
            )
        )
    if report.notes:
        sections.append(("Notes", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>"))
    return html_page("Draft evaluation (eval/acceptance.json)", sections)


def provenance_page(provenance: dict[str, Any]) -> str:
    created = provenance.get("created_unix")
    facts = [
        ("run", provenance.get("run", "")),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created)) if created else ""),
        ("git commit", provenance.get("git_commit", "")),
        ("uncommitted changes", "yes" if provenance.get("git_dirty") else "no"),
        ("host", provenance.get("host", "")),
        ("platform", provenance.get("platform", "")),
        ("python", provenance.get("python", "")),
        ("accelerators", ", ".join(provenance.get("accelerators") or []) or "none"),
    ]
    packages = html_table(["package", "version"], sorted((provenance.get("packages") or {}).items()))
    config = f"<pre>{html.escape(json.dumps(provenance.get('config', {}), indent=2, sort_keys=True))}</pre>"
    return html_page(
        "Provenance", [("Run", key_value_table(facts)), ("Packages", packages), ("Resolved config", config)]
    )


def summary_page(
    provenance: dict[str, Any],
    manifest: dict[str, Any],
    extraction: Sequence[dict[str, Any]],
    training: dict[str, Any],
    metrics: Any | None,
    acceptance: AcceptanceReport,
) -> str:
    final_loss = training.get("final_train_loss")
    if final_loss is None and metrics is not None and "loss" in metrics.columns and metrics["loss"].notna().any():
        final_loss = float(metrics["loss"].dropna().iloc[-1])
    rows = [
        ("run", provenance.get("run", "")),
        ("git commit", provenance.get("git_commit", "") + (" (dirty)" if provenance.get("git_dirty") else "")),
        ("records kept / read", f"{manifest.get('records_kept', '?')} / {manifest.get('records_read', '?')}"),
        ("tokens extracted", sum(int(m.get("tokens", 0) or 0) for m in extraction)),
        ("final training loss", final_loss if final_loss is not None else "n/a"),
        ("final validation loss", training.get("final_val_loss", "n/a") if training else "n/a"),
        ("acceptance length, trained draft", acceptance.trained.mean_acceptance_length),
        ("acceptance length, untrained draft", acceptance.untrained.mean_acceptance_length),
        ("speedup, trained draft", f"x{acceptance.trained.speedup:.2f} on {acceptance.device}"),
        ("lossless (greedy output unchanged)", acceptance.lossless),
    ]
    return html_page("Summary", [("Run at a glance", key_value_table(rows))])


# ----------------------------------------------------------------------------------------------------------------
# The two rules


def summarize_run(inputs: ReportInputs, outputs: ReportOutputs) -> None:
    """Write every figure and table of the report from the artefacts."""
    provenance = read_json(inputs.provenance)
    manifest = read_json(inputs.manifest)
    extraction = [read_json(p) for p in inputs.extraction]
    acceptance = AcceptanceReport.from_dict(read_json(inputs.acceptance))
    metrics_path = inputs.draft / "metrics.csv"
    metrics = read_training_metrics(metrics_path)
    training_json = inputs.draft / "training.json"
    training = read_json(training_json) if training_json.exists() else {}

    plot_data(manifest, outputs.data)
    _write(outputs.data_table, data_page(manifest))
    _write(
        outputs.gates, gates_page(read_json(inputs.api_compat), read_json(inputs.canary), read_json(inputs.validation))
    )
    plot_extraction(extraction, outputs.extraction)
    _write(outputs.extraction_table, extraction_page(extraction))
    plot_training(metrics, outputs.training, source=str(metrics_path))
    plot_acceptance(acceptance, outputs.acceptance)
    _write(outputs.acceptance_table, acceptance_page(acceptance))
    _write(outputs.provenance, provenance_page(provenance))
    _write(outputs.summary, summary_page(provenance, manifest, extraction, training, metrics, acceptance))


def nested_report_command(
    snakefile: str, config_path: Path, html_path: Path, python: str = sys.executable
) -> list[str]:
    return [
        python,
        "-m",
        "snakemake",
        "-s",
        snakefile,
        "--configfile",
        str(config_path),
        "--nolock",
        "--report",
        str(html_path),
    ]


def build_report(snakefile: str, config: dict[str, Any], html_path: Path, work_dir: Path, log_path: str | None) -> None:
    """Run Snakemake's report on this workflow, with the outer run's resolved config."""
    config_path = work_dir / "resolved_config.json"
    write_json_atomic(config_path, config)
    cmd = nested_report_command(snakefile, config_path, html_path)
    log.info("building the Snakemake report: %s", " ".join(cmd))
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    output = (proc.stdout + proc.stderr).strip()
    if log_path:
        with open(log_path, "a", encoding="utf-8") as sink:
            sink.write(output + "\n")
    if proc.returncode != 0 or not html_path.exists():
        tail = "\n".join(output.splitlines()[-40:])
        raise StageError(
            f"`snakemake --report` exited with code {proc.returncode} (command: {' '.join(cmd)}); its last lines:\n"
            f"{tail}"
        )
    log.info("report %s (%.1f MB) in %.1f s", html_path, html_path.stat().st_size / 1e6, time.perf_counter() - started)


def summarize_main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        i, o = snakemake.input, snakemake.output
        summarize_run(
            ReportInputs(
                provenance=Path(i.provenance),
                manifest=Path(i.manifest),
                api_compat=Path(i.api_compat),
                canary=Path(i.canary),
                extraction=[Path(p) for p in i.extraction],
                validation=Path(i.validation),
                draft=Path(i.draft),
                acceptance=Path(i.acceptance),
            ),
            ReportOutputs(**{f.name: Path(getattr(o, f.name)) for f in dataclasses.fields(ReportOutputs)}),
        )

    run_stage("summarize_run", snakemake.log[0], body)


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        build_report(
            snakemake.params.snakefile,
            json.loads(snakemake.params.config),
            Path(snakemake.output.html),
            Path(snakemake.params.work_dir),
            snakemake.log[0],
        )

    run_stage("report", snakemake.log[0], body)
