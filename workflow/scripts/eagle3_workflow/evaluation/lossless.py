"""The lossless check (pure): the first token where a speculative run differs from the reference, per prompt,
with the reference's logprob gap between the two tokens, and the StageError message that spells them out."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eagle3_workflow.artefacts import LosslessMismatch
from eagle3_workflow.errors import render_table


def first_divergence(expected: Sequence[int], found: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, found, strict=False)):
        if a != b:
            return i
    if len(expected) != len(found):
        return min(len(expected), len(found))
    return None


def compare_greedy(
    reference: Sequence[Sequence[int]],
    candidate: Sequence[Sequence[int]],
    *,
    origins: Sequence[str],
    reference_logprobs: Sequence[Sequence[dict[int, float]]] | None,
    tolerance: float,
    decode: Callable[[Sequence[int]], str] = lambda ids: " ".join(map(str, ids)),
    context_tokens: int = 12,
) -> list[LosslessMismatch]:
    """The first divergence of each prompt whose candidate output differs from the reference."""
    mismatches = []
    for index, (expected, found) in enumerate(zip(reference, candidate, strict=True)):
        position = first_divergence(expected, found)
        if position is None:
            continue
        expected_token = expected[position] if position < len(expected) else None
        found_token = found[position] if position < len(found) else None
        gap = None
        if expected_token is not None and found_token is not None and reference_logprobs is not None:
            top = reference_logprobs[index][position] if position < len(reference_logprobs[index]) else {}
            if expected_token in top and found_token in top:
                gap = float(top[expected_token] - top[found_token])
        mismatches.append(
            LosslessMismatch(
                prompt_index=index,
                origin=origins[index],
                position=position,
                expected_token=expected_token,
                found_token=found_token,
                logprob_gap=gap,
                tolerated=gap is not None and gap <= tolerance,
                context=decode(expected[max(0, position - context_tokens) : position]),
                expected_text=decode(expected[position : position + 8]) if expected_token is not None else "<end>",
                found_text=decode(found[position : position + 8]) if found_token is not None else "<end>",
            )
        )
    return mismatches


def describe_mismatch(label: str, mismatch: LosslessMismatch) -> str:
    gap = "not in the reference's top-5" if mismatch.logprob_gap is None else f"{mismatch.logprob_gap:.4f}"
    return (
        f"prompt {mismatch.prompt_index} ({mismatch.origin}), generated token {mismatch.position}:\n"
        f"  context:                 ...{mismatch.context!r}\n"
        f"  without speculation:     {mismatch.expected_text!r} (token {mismatch.expected_token})\n"
        f"  with the {label} draft: {mismatch.found_text!r} (token {mismatch.found_token})\n"
        f"  reference logprob gap:   {gap}"
    )


def lossless_failure(results: dict[str, list[LosslessMismatch]], num_prompts: int, tolerance: float) -> str:
    """The StageError message: counts, the first real mismatch spelled out, then a table of all of them."""
    rows = []
    for label, mismatches in results.items():
        for m in mismatches:
            gap = "-" if m.logprob_gap is None else f"{m.logprob_gap:.4f}"
            rows.append(
                (
                    label,
                    m.prompt_index,
                    m.origin,
                    m.position,
                    m.expected_token,
                    m.found_token,
                    gap,
                    "yes" if m.tolerated else "NO",
                )
            )
    label, first = next((lbl, m) for lbl, ms in results.items() for m in ms if not m.tolerated)
    counts = ", ".join(
        f"{sum(not m.tolerated for m in ms)}/{num_prompts} prompts with the {lbl} draft" for lbl, ms in results.items()
    )
    table = render_table(["draft", "prompt", "origin", "token", "expected", "found", "gap", "tolerated"], rows)
    return (
        f"speculative decoding changed the greedy output (not lossless): {counts}.\n"
        f"First mismatch:\n{describe_mismatch(label, first)}\n\nAll first divergences:\n{table}\n"
        "EAGLE-3 verification must reproduce greedy decoding exactly, so this points at the spec-decode path of "
        "this vLLM for this target (or the draft config). If every gap is a tiny numerical near-tie (batched bf16 "
        f"on GPU), raise evaluate.lossless_logprob_tolerance (now {tolerance}) after reading them."
    )
