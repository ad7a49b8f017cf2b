"""Acceptance from vLLM's spec-decode counters (pure): the counters of a get_metrics() snapshot, what one pass
added, acceptance length and per-position rates, one run's AcceptanceResult and the summary table of the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3_workflow.evaluation.protocol import NO_SPECULATION, RunResult
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, AcceptanceResult, LosslessMismatch, Throughput
from eagle3_workflow.serving.engine import PER_POSITION_METRIC, SPEC_COUNTERS
from eagle3_workflow.settings.errors import StageError, render_table


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


def throughput(run: RunResult, reference: RunResult | None) -> list[Throughput]:
    """The timing passes of one engine, with the speed-up over no speculation at the same concurrency and, at
    concurrency 1, the time of one target forward pass (a verification step with speculation)."""
    rows = []
    for timing in run.timings:
        same = reference.timing_at(timing.concurrency) if reference is not None else None
        forwards = timing.verify_steps if timing.verify_steps is not None else timing.generated_tokens
        rows.append(
            Throughput(
                concurrency=timing.concurrency,
                prompts=timing.prompts,
                generated_tokens=timing.generated_tokens,
                seconds=timing.seconds,
                tokens_per_s=timing.tokens_per_s,
                speedup=timing.tokens_per_s / same.tokens_per_s if same is not None and same.tokens_per_s else None,
                ms_per_step=1000 * timing.seconds / forwards if timing.concurrency == 1 and forwards else None,
            )
        )
    return rows


def acceptance_result(
    lossless_run: RunResult,
    timing_run: RunResult | None,
    *,
    draft_path: Path,
    num_speculative_tokens: int,
    reference_timing: RunResult,
    mismatches: list[LosslessMismatch],
    non_argmax: list[str],
) -> AcceptanceResult:
    """One draft: acceptance from the lossless pass's counters, tokens/s from the timing passes (none when the
    draft was not timed: no throughput rows, tokens_per_s and speedup 0)."""
    after = counters_from_metrics(lossless_run.metrics_after)
    if after is None:
        found = sorted({m["name"] for m in lossless_run.metrics_after}) or "none"
        raise StageError(
            f"the {lossless_run.label} run exposed no vLLM spec-decode counters (expected {sorted(SPEC_COUNTERS)}; "
            f"found {found}): speculation did not run or this vLLM renamed its metrics; check_api should pin them"
        )
    counters = counters_delta(counters_from_metrics(lossless_run.metrics_before), after)
    stats = acceptance_from_counters(counters, num_speculative_tokens)
    rows = throughput(timing_run, reference_timing) if timing_run is not None else []
    first = rows[0] if rows else None
    return AcceptanceResult(
        label=lossless_run.label,
        draft_path=str(draft_path),
        mean_acceptance_length=stats.mean_acceptance_length,
        per_position_acceptance=stats.per_position_acceptance,
        num_drafts=counters.num_drafts,
        draft_tokens=counters.num_draft_tokens,
        accepted_tokens=counters.num_accepted_tokens,
        tokens_per_s=first.tokens_per_s if first else 0.0,
        accepted_per_position=stats.accepted_per_position,
        draft_acceptance_rate=stats.draft_acceptance_rate,
        generated_tokens=lossless_run.generated_tokens,
        generate_s=lossless_run.generate_s,
        speedup=(first.speedup or 0.0) if first else 0.0,
        engine_start_s=(timing_run or lossless_run).engine_start_s,
        lossless=all(m.tie for m in mismatches) and not non_argmax,
        mismatches=mismatches,
        non_argmax_steps=non_argmax,
        throughput=rows,
    )


def summary_table(report: AcceptanceReport) -> str:
    levels = [t.concurrency for t in report.no_speculation_throughput]
    tps = [f"tokens/s @{c}" for c in levels]
    rows: list[tuple[object, ...]] = [
        (NO_SPECULATION, "-", "-", *(f"{t.tokens_per_s:.1f}" for t in report.no_speculation_throughput),
         "1.00", "-"),
    ]  # fmt: skip
    for result in (report.trained, report.untrained):
        rows.append(
            (
                result.label,
                f"{result.mean_acceptance_length:.3f}",
                " ".join(f"{r:.2f}" for r in result.per_position_acceptance),
                *(f"{t.tokens_per_s:.1f}" for t in result.throughput),
                *(["not timed"] * len(levels) if not result.throughput else []),
                f"{result.speedup:.2f}" if result.throughput else "-",
                "yes" if result.lossless else f"NO ({sum(not m.tie for m in result.mismatches)})",
            )
        )
    headers = ["run", "acceptance length", "per position", *tps, f"speedup @{levels[0] if levels else '-'}"]
    return render_table([*headers, "lossless"], rows)
