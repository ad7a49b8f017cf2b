"""Acceptance from vLLM's spec-decode counters (pure): the counters of a get_metrics() snapshot, what one pass
added, acceptance length and per-position rates, one run's AcceptanceResult and the summary table of the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3_workflow.artefacts import AcceptanceReport, AcceptanceResult, LosslessMismatch
from eagle3_workflow.errors import StageError, render_table
from eagle3_workflow.evaluation.protocol import NO_SPECULATION, RunResult

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclasses.dataclass
class SpecDecodeCounters:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]


def counters_from_metrics(metrics: Iterable[dict[str, Any]]) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from a get_metrics() snapshot (as dicts), summed over engines.

    None when the snapshot holds none of them: speculation was off, or this vLLM renamed the counters.
    """
    totals = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    per_position: list[int] = []
    found = False
    for metric in metrics:
        name = metric["name"]
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] += int(metric["value"])
            found = True
        elif name == PER_POSITION_METRIC:
            values = [int(v) for v in metric["values"]]
            per_position += [0] * (len(values) - len(per_position))
            for i, value in enumerate(values):
                per_position[i] += value
    if not found:
        return None
    return SpecDecodeCounters(accepted_per_position=per_position, **totals)


def counters_delta(before: SpecDecodeCounters | None, after: SpecDecodeCounters) -> SpecDecodeCounters:
    """What one generate() call added (the counters are cumulative over the engine's life)."""
    if before is None:
        return after
    width = max(len(before.accepted_per_position), len(after.accepted_per_position))
    pad_before = before.accepted_per_position + [0] * (width - len(before.accepted_per_position))
    pad_after = after.accepted_per_position + [0] * (width - len(after.accepted_per_position))
    return SpecDecodeCounters(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=[a - b for a, b in zip(pad_after, pad_before, strict=True)],
    )


@dataclasses.dataclass
class AcceptanceStats:
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    draft_acceptance_rate: float
    accepted_per_position: list[int]


def acceptance_from_counters(counters: SpecDecodeCounters, num_speculative_tokens: int) -> AcceptanceStats:
    """Acceptance length (1 + accepted / drafts, the bonus token included) and per-position rates."""
    if counters.num_drafts <= 0:
        raise StageError(
            f"vLLM proposed no drafts ({counters}); speculation did not run. Check evaluate.max_tokens (>= 2) "
            "and that the engine log shows the EAGLE-3 drafter loading."
        )
    per_position = (counters.accepted_per_position + [0] * num_speculative_tokens)[:num_speculative_tokens]
    return AcceptanceStats(
        mean_acceptance_length=1.0 + counters.num_accepted_tokens / counters.num_drafts,
        per_position_acceptance=[a / counters.num_drafts for a in per_position],
        draft_acceptance_rate=(
            counters.num_accepted_tokens / counters.num_draft_tokens if counters.num_draft_tokens else 0.0
        ),
        accepted_per_position=per_position,
    )


def acceptance_result(
    run: RunResult,
    *,
    draft_path: Path,
    num_speculative_tokens: int,
    reference: RunResult,
    mismatches: list[LosslessMismatch],
) -> AcceptanceResult:
    after = counters_from_metrics(run.metrics_after)
    if after is None:
        found = sorted({m["name"] for m in run.metrics_after}) or "none"
        raise StageError(
            f"the {run.label} run exposed no vLLM spec-decode counters (expected {sorted(SPEC_COUNTERS)}; found "
            f"{found}): speculation did not run or this vLLM renamed its metrics; check_api should pin them"
        )
    counters = counters_delta(counters_from_metrics(run.metrics_before), after)
    stats = acceptance_from_counters(counters, num_speculative_tokens)
    tokens_per_s, reference_tps = run.tokens_per_s, reference.tokens_per_s
    return AcceptanceResult(
        label=run.label,
        draft_path=str(draft_path),
        mean_acceptance_length=stats.mean_acceptance_length,
        per_position_acceptance=stats.per_position_acceptance,
        num_drafts=counters.num_drafts,
        draft_tokens=counters.num_draft_tokens,
        accepted_tokens=counters.num_accepted_tokens,
        tokens_per_s=tokens_per_s,
        accepted_per_position=stats.accepted_per_position,
        draft_acceptance_rate=stats.draft_acceptance_rate,
        generated_tokens=run.generated_tokens,
        generate_s=run.generate_s,
        speedup=tokens_per_s / reference_tps if reference_tps else 0.0,
        engine_start_s=run.engine_start_s,
        lossless=all(m.tolerated for m in mismatches),
        mismatches=mismatches,
    )


def summary_table(report: AcceptanceReport) -> str:
    rows: list[tuple[object, ...]] = [
        (NO_SPECULATION, "-", "-", f"{report.no_speculation_tokens_per_s:.1f}", "1.00", "-"),
    ]
    for result in (report.trained, report.untrained):
        rows.append(
            (
                result.label,
                f"{result.mean_acceptance_length:.3f}",
                " ".join(f"{r:.2f}" for r in result.per_position_acceptance),
                f"{result.tokens_per_s:.1f}",
                f"{result.speedup:.2f}",
                "yes" if result.lossless else f"NO ({len(result.mismatches)})",
            )
        )
    return render_table(["run", "acceptance length", "per position", "tokens/s", "speedup", "lossless"], rows)
