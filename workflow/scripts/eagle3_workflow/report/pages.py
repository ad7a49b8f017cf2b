"""The report's tables: small self-contained HTML pages built from the artefacts (pure: strings in, strings out)."""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from typing import Any

from eagle3_workflow.files.data_artefacts import CanaryReport, DataManifest, ExtractionManifest, ValidationReport
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, Provenance, TrainingSummary
from eagle3_workflow.files.target_artefacts import ApiCompatReport

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


def data_page(manifest: DataManifest) -> str:
    scalars = [
        (key, value)
        for key, value in manifest.model_dump().items()
        if not isinstance(value, dict | list) and value is not None
    ]
    sections = [("Counts", key_value_table(scalars))]
    if manifest.dropped:
        sections.append(
            ("Dropped records by reason", html_table(["reason", "records"], list(manifest.dropped.items())))
        )
    if manifest.length_percentiles:
        sections.append(("Sequence length (tokens)", key_value_table(list(manifest.length_percentiles.items()))))
    if manifest.sources:
        sections.append(("Sources", html_table(["path"], [[s] for s in manifest.sources])))
    return html_page("Prepared data (data/manifest.json)", sections)


def _checks(report: ApiCompatReport | CanaryReport) -> str:
    rows = [(c.name, c.expected, c.found, c.passed, c.detail) for c in report.checks]
    return html_table(["check", "expected", "found", "pass", "detail"], rows) if rows else "<p>no checks recorded</p>"


def gates_page(api_compat: ApiCompatReport, canary: CanaryReport, validation: ValidationReport) -> str:
    versions = [
        (k, v) for k, v in api_compat.model_dump().items() if k.endswith("_version") or k in ("device", "layer_ids")
    ]
    canary_errors = [
        (layer, max_rel, canary.per_layer_mean_rel_error.get(layer))
        for layer, max_rel in canary.per_layer_max_rel_error.items()
    ]
    validation_rows = [
        (k, v if not isinstance(v, list | dict) else (len(v) if k != "files_dir" else ", ".join(map(str, v))))
        for k, v in validation.model_dump().items()
    ]
    depth = validation.full_depth
    if depth is not None:  # which proof ran past the canary's slice, said in words (the row above counts its keys)
        validation_rows.append(("full-depth proof", f"{depth.proof} ({depth.reference}; passed {depth.passed})"))
    return html_page(
        "Gates",
        [
            (
                f"check_api: {'PASS' if api_compat.passed else 'FAIL'}",
                key_value_table(versions) + _checks(api_compat),
            ),
            (
                f"canary: {'PASS' if canary.passed else 'FAIL'} (proof {canary.proof}; {canary.canary_layers} "
                f"layers vs {canary.reference}, tolerance {canary.tolerance})",
                html_table(["layer id", "max relative error", "mean relative error"], canary_errors) + _checks(canary),
            ),
            ("validate_hidden_states", key_value_table(validation_rows)),
        ],
    )


def extraction_page(manifests: Sequence[ExtractionManifest]) -> str:
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
    rows = [[getattr(m, c) for c in columns] for m in manifests]
    total_tokens = sum(m.tokens for m in manifests)
    total_wall = max((m.wall_s for m in manifests), default=0.0)
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
    sections = [
        ("Results", _acceptance_results(report)),
        ("Tokens / s by concurrency (production settings)", _throughput_table(report)),
        ("Setup", _acceptance_setup(report)),
        ("Measurement processes", _measurement_processes(report)),
    ]
    mismatches = _greedy_divergences(report)
    if mismatches:
        sections.append(
            (
                "Greedy divergences",
                html_table(
                    [
                        "draft",
                        "prompt",
                        "origin",
                        "token",
                        "expected",
                        "found",
                        "gap steps (ref)",
                        "gap steps (spec)",
                        "tie",
                    ],
                    mismatches,
                ),
            )
        )
    if report.notes:
        sections.append(("Notes", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>"))
    return html_page("Draft evaluation (eval/acceptance.json)", sections)


def _acceptance_results(report: AcceptanceReport) -> str:
    """One row per run: no speculation (the baseline), then the trained and the untrained draft."""
    k = report.num_speculative_tokens
    headers = ["run", "mean acceptance length", "draft acceptance rate"] + [f"pos {i + 1}" for i in range(k)]
    first = report.no_speculation_throughput[0].concurrency if report.no_speculation_throughput else "-"
    headers += ["drafts", "accepted", "tokens", "seconds", f"tokens / s @{first}", f"speedup @{first}",
                "engine start s", "lossless"]  # fmt: skip
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
                r.tokens_per_s if r.throughput else "not timed",
                r.speedup if r.throughput else "-",
                r.engine_start_s,
                r.lossless,
            ]
        )
    return html_table(headers, rows)


def _throughput_table(report: AcceptanceReport) -> str:
    """tokens/s of each engine at each timing concurrency, the speed-up over no speculation, the step time."""
    rows = []
    for label, timings in (
        ("no speculation", report.no_speculation_throughput),
        (report.trained.label, report.trained.throughput),
        (report.untrained.label, report.untrained.throughput),
    ):
        for t in timings:
            speedup = 1.0 if t.speedup is None and label == "no speculation" else t.speedup
            rows.append([label, t.concurrency, t.prompts, t.generated_tokens, t.seconds, t.tokens_per_s, speedup,
                         "" if t.ms_per_step is None else t.ms_per_step])  # fmt: skip
    headers = ["run", "concurrency", "prompts", "tokens", "seconds", "tokens / s", "speedup", "ms per target step"]
    return html_table(headers, rows)


def _acceptance_setup(report: AcceptanceReport) -> str:
    return key_value_table(
        [
            ("prompts", f"{report.num_prompts} of {report.num_prompts_requested} requested ({report.prompt_source})"),
            ("prompt detail", report.prompt_detail),
            ("num_speculative_tokens", report.num_speculative_tokens),
            ("max_tokens", report.max_tokens),
            ("device", report.device),
            ("vLLM", report.vllm_version),
            ("lossless", report.lossless),
            ("lossless criterion", report.lossless_criterion),
            ("lossless pass kernels", report.lossless_numerics),
            ("lossless reference", report.lossless_reference),
            ("first divergences (ties included)", report.lossless_mismatches),
            ("untrained baseline", report.untrained_baseline),
            ("draft parity", _parity_summary(report)),
        ]
    )


def _parity_summary(report: AcceptanceReport) -> str:
    """One line for the draft parity check (acceptance.json's `parity`)."""
    parity = report.parity
    if parity is None:
        return "not recorded (acceptance.json written before the check existed)"
    return (
        f"{parity.verdict}: {parity.agreeing_steps} of {parity.steps_compared} served steps agree, "
        f"{parity.ties_excused} near-ties excused, {parity.differing_steps} differ "
        f"({len(parity.prompts)} prompts, {parity.proposals_compared} proposals compared; reference {parity.reference})"
    )


def _measurement_processes(report: AcceptanceReport) -> str:
    return html_table(
        ["engines", "process wall s", "vLLM import s", "engine start s", "host load (1 min)"],
        [
            [", ".join(p.runs), p.wall_s, p.vllm_import_s, json.dumps(p.engine_start_s), p.load_1m]
            for p in report.processes
        ],
    )


def _greedy_divergences(report: AcceptanceReport) -> list[tuple[Any, ...]]:
    return [
        (
            r.label,
            m.prompt_index,
            m.origin,
            m.position,
            m.expected_text,
            m.found_text,
            "-" if m.reference_gap_steps is None else m.reference_gap_steps,
            "-" if m.candidate_gap_steps is None else m.candidate_gap_steps,
            m.tie,
        )
        for r in (report.trained, report.untrained)
        for m in r.mismatches
    ]


def provenance_page(provenance: Provenance) -> str:
    created = provenance.created_unix
    facts = [
        ("run", provenance.run),
        ("created", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created)) if created else ""),
        ("git commit", provenance.git_commit),
        ("uncommitted changes", "yes" if provenance.git_dirty else "no"),
        ("files (git tree id; `git log --format='%H %T'` finds the commit)", provenance.git_tree or "not recorded"),
        ("host", provenance.host),
        ("platform", provenance.platform),
        ("python", provenance.python),
        ("accelerators", ", ".join(provenance.accelerators) or "none"),
    ]
    packages = html_table(["package", "version"], sorted(provenance.packages.items()))
    config = f"<pre>{html.escape(json.dumps(provenance.config, indent=2, sort_keys=True))}</pre>"
    return html_page(
        "Provenance", [("Run", key_value_table(facts)), ("Packages", packages), ("Resolved config", config)]
    )


def summary_page(
    *,
    provenance: Provenance,
    manifest: DataManifest,
    extraction: Sequence[ExtractionManifest],
    training: TrainingSummary,
    metrics: Any | None,
    acceptance: AcceptanceReport,
) -> str:
    final_loss = training.final_train_loss
    if final_loss is None and metrics is not None and "loss" in metrics.columns and metrics["loss"].notna().any():
        final_loss = float(metrics["loss"].dropna().iloc[-1])
    rows = [
        ("run", provenance.run),
        ("git commit", provenance.git_commit + (" (dirty)" if provenance.git_dirty else "")),
        ("records kept / read", f"{manifest.records_kept} / {manifest.records_read}"),
        ("tokens extracted", sum(m.tokens for m in extraction)),
        ("hidden states", training.hidden_states_source()),
        ("final training loss", final_loss if final_loss is not None else "n/a"),
        ("final validation loss", training.final_val_loss),
        ("acceptance length, trained draft", acceptance.trained.mean_acceptance_length),
        ("acceptance length, untrained draft", acceptance.untrained.mean_acceptance_length),
        ("speedup, trained draft", f"x{acceptance.trained.speedup:.2f} on {acceptance.device}"),
        ("lossless (greedy output unchanged)", acceptance.lossless),
    ]
    return html_page("Summary", [("Run at a glance", key_value_table(rows))])
