"""The full-depth proof of validate_hidden_states: every captured production layer id, on the whole target.

The canary proves the capture on a K-layer slice, and the greedy cross-check proves id N only. A capture that goes
wrong past the slice (id 16 of a 32-layer target filled from layer 17) passes both. Here every slot of a few extracted
samples (the longest and the shortest) is compared with an fp32 reference of the WHOLE target at every depth: the
input of each layer 0..N-1 (HF ``output_hidden_states[k]``), the pre-norm output of the last layer (id N) and the
final norm's output. With the canary's matching (layer_match), each slot must be nearest to the layer it claims
(so also nearer than its neighbours) and within tolerance of it; every wrong slot is named. The error rule is the
canary's too (reference.layer_match.SlotComparison): on an MoE target a token above the tolerance is excused only where the
reference's own router margins show a near-tie bf16 serving may have routed the other way (counted per slot; at
most reference.layer_match.MAX_EXCUSED_FRACTION of the tokens), so both gates agree.

The reference is streamed one decoder layer at a time (memory of one layer; reference/full_depth.py, shared with
check_api's preflight); each reference state is compared with the slots as it streams by, none is kept. No vLLM here,
no subprocess.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from eagle3_workflow.files.data_artefacts import DepthSlot, FullDepthReport
from eagle3_workflow.files.hidden_states import human_bytes, read_hidden_states
from eagle3_workflow.reference.full_depth import REFERENCE, stream_reference
from eagle3_workflow.reference.layer_match import MAX_EXCUSED_FRACTION, SlotComparison, SlotError, SlotMatch
from eagle3_workflow.settings.errors import StageError, render_table
from eagle3_workflow.settings.stages import ValidateHiddenStatesStage

log = logging.getLogger("eagle3.full_depth")

FULL_DEPTH_PROOF = "hf_fp32"  # every slot vs the fp32 reference of every depth (the canary's strong proof)
UNSAFE_OFF = (
    "validation.full_depth_check is false: the captured ids past the canary's slice were NOT compared with the "
    "target (UNSAFE: a capture that is wrong only deep in the model trains a useless draft)"
)


# ------------------------------------------------------------------------------------------------ which samples


def pick_rows(lengths: Mapping[int, int]) -> list[int]:
    """The longest sample (rotary embeddings and the causal mask far out) and the shortest; the lowest row on ties."""
    if not lengths:
        return []
    longest = min(lengths, key=lambda row: (-lengths[row], row))
    shortest = min(lengths, key=lambda row: (lengths[row], row))
    return [longest] if longest == shortest else [longest, shortest]


# ------------------------------------------------------------------------------------------------ the verdicts


def slot_verdicts(
    matches: Sequence[SlotMatch], errors: Mapping[str, SlotError | float], tolerance: float
) -> list[DepthSlot]:
    """Each slot: nearest to its own layer of all depths, and its error against that layer within tolerance (tokens
    a near-tied MoE routing explains excused, at most MAX_EXCUSED_FRACTION of them: layer_match)."""
    verdicts = []
    for m in matches:
        found = errors[str(m.claimed)]
        row = found if isinstance(found, SlotError) else SlotError(found, found, 0.0, 1, 0, 0)
        if not m.ok:
            problem = f"WRONG LAYER: id {m.claimed} is layer {m.best} (rel {m.best_rel:.3g}; vs its own layer {m.own_rel:.3g})"
        elif row.max_rel > tolerance:
            problem = f"TOO FAR: id {m.claimed} max rel error {row.max_rel:.3g} > tolerance {tolerance:g}"
        elif not row.excused_ok:
            problem = (
                f"TOO FAR: id {m.claimed}: {row.excused} of {row.tokens} tokens above tolerance {tolerance:g} (max "
                f"{row.raw_max_rel:.3g}), more than {MAX_EXCUSED_FRACTION:.0%} a near-tied MoE routing may explain"
            )
        else:
            problem = ""
        verdicts.append(
            DepthSlot(
                claimed=m.claimed,
                best=m.best,
                best_rel=m.best_rel,
                runner_up=m.runner_up,
                runner_up_rel=m.runner_up_rel,
                own_rel=m.own_rel,
                margin=round(m.margin, 3),
                max_rel_error=row.max_rel,
                ok=not problem,
                problem=problem,
                tokens=row.tokens,
                ambiguous_tokens=row.ambiguous,
                excused_tokens=row.excused,
            )
        )
    return verdicts


def read_slots(files_dir: Path, row: int, tokens: int) -> torch.Tensor:
    """The first `tokens` positions of an extracted sample's hidden states, [T, L, H]."""
    return read_hidden_states(files_dir, row, slice(None, tokens))


def full_depth_check(
    target_dir: Path,
    files_dir: Path,
    samples: Mapping[int, Sequence[int]],
    layer_ids: Sequence[int],
    *,
    tolerance: float,
    max_tokens: int,
    trust_remote_code: bool,
    device: str,
) -> FullDepthReport:
    """Every captured id of the longest and the shortest of `samples` (row -> input ids, files in `files_dir`)
    against the streamed fp32 reference of the whole target; the report names every wrong slot."""
    started = time.monotonic()
    rows = pick_rows({row: len(ids) for row, ids in samples.items()})
    if not rows:
        raise StageError("the full-depth check has no valid extracted sample to compare")
    batch = [list(samples[row])[:max_tokens] for row in rows]
    comparison = SlotComparison(
        [read_slots(files_dir, row, len(ids)) for row, ids in zip(rows, batch, strict=True)], layer_ids
    )
    with comparison.routing:
        num_layers, peak = stream_reference(
            target_dir, batch, comparison, trust_remote_code=trust_remote_code, device=device
        )
    try:
        matches = comparison.matches(num_layers)
    except ValueError as exc:
        raise StageError(f"the full-depth reference did not run through the target: {exc!r}") from exc
    slots = slot_verdicts(matches, comparison.errors(tolerance), tolerance)
    return FullDepthReport(
        enabled=True,
        passed=all(s.ok for s in slots),
        reference=REFERENCE,
        proof=FULL_DEPTH_PROOF,
        num_layers=num_layers,
        layer_ids=list(layer_ids),
        rows=rows,
        tokens=[len(ids) for ids in batch],
        max_tokens_per_sample=max_tokens,
        tolerance=tolerance,
        slots=slots,
        largest_layer_bytes=peak,
        wall_s=round(time.monotonic() - started, 2),
        reference_device=device,
    )


def disabled_report(layer_ids: Sequence[int], *, tolerance: float, max_tokens: int) -> FullDepthReport:
    return FullDepthReport(
        enabled=False,
        passed=None,
        reference="none (turned off)",
        proof="none",
        num_layers=max(layer_ids),
        layer_ids=list(layer_ids),
        rows=[],
        tokens=[],
        max_tokens_per_sample=max_tokens,
        tolerance=tolerance,
        slots=[],
        largest_layer_bytes=0,
        wall_s=0.0,
        note=UNSAFE_OFF,
    )


def slot_table(report: FullDepthReport) -> str:
    return render_table(
        ["id", "nearest layer (rel)", "next nearest (rel)", "own layer rel", "max rel error", "MoE excused", "verdict"],
        [
            (
                s.claimed,
                f"{s.best} ({s.best_rel:.3g})",
                f"{s.runner_up} ({s.runner_up_rel:.3g})",
                f"{s.own_rel:.3g}",
                f"{s.max_rel_error:.3g}",
                f"{s.excused_tokens}/{s.tokens} (ambiguous {s.ambiguous_tokens})",
                s.problem or "ok",
            )
            for s in report.slots
        ],
    )


WRONG_LAYER_ADVICE = (
    "The capture is wrong past the canary's slice (a layer-id remap in this vLLM build or its model code): the "
    "hidden states are unusable for training; do not raise the tolerance. Check the vLLM version against envs/, "
    "then rerun extraction (snakemake --forcerun extract_hidden_states)."
)
TOO_FAR_ADVICE = (
    "Every id is nearest to its own layer, but farther from it than the tolerance: numerical drift of the serving "
    "dtype through the whole depth, or a capture that scales or corrupts the state. Compare with the canary's errors "
    "(checks/canary.json) and the margins above; raise validation.full_depth_relative_tolerance only if the drift is "
    "the dtype's (it grows with depth), then rerun validate_hidden_states."
)


def failure_message(report: FullDepthReport) -> str:
    wrong = [s for s in report.slots if not s.ok]
    wrong_layer = any(s.best != str(s.claimed) for s in wrong)
    return (
        f"full-depth check FAILED: {len(wrong)} of {len(report.slots)} captured ids do not hold their own layer of the "
        f"{report.num_layers}-layer target (rows {report.rows}, {report.tokens} tokens, vs {report.reference}; each id "
        f"must be nearest to its own layer of all 0..{report.num_layers} (+ post-norm) and within max rel error "
        f"{report.tolerance:g}):\n{slot_table(report)}\n{WRONG_LAYER_ADVICE if wrong_layer else TOO_FAR_ADVICE}"
    )


def check_stage(
    settings: ValidateHiddenStatesStage,
    *,
    target_dir: Path,
    files_dir: Path,
    samples: Mapping[int, Sequence[int]],
    layer_ids: Sequence[int],
) -> FullDepthReport:
    """validate_hidden_states' adapter: the check as configured (or the unsafe note when turned off); a failed check
    raises with its table."""
    validation = settings.validation
    limits = dict(tolerance=validation.full_depth_relative_tolerance, max_tokens=validation.full_depth_max_tokens)
    if not validation.full_depth_check:
        log.warning("%s", UNSAFE_OFF)
        return disabled_report(layer_ids, **limits)
    report = full_depth_check(
        target_dir,
        files_dir,
        samples,
        layer_ids,
        trust_remote_code=settings.target.trust_remote_code,
        device=settings.reference.device,
        **limits,
    )
    if not report.passed:
        raise StageError(failure_message(report))
    log.info(
        "full-depth check passed: every id of rows %s (%s tokens) holds its own layer of the %d-layer target "
        "(%.1f s, at most %s of weights held):\n%s",
        report.rows,
        report.tokens,
        report.num_layers,
        report.wall_s,
        human_bytes(report.largest_layer_bytes),
        slot_table(report),
    )
    return report
