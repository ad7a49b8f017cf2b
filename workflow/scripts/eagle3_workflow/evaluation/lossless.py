"""The lossless check (pure): the first token where a speculative run differs from its reference, per prompt,
judged by both runs' own raw logits, and the StageError message that spells them out.

The criterion:
- every token any run emitted is the argmax of that run's own logits at that step (a wrong acceptance, a draft
  token the verifier did not choose, fails here whatever the setting); the margin of a failure is how many dtype
  steps the emitted token lies below the argmax (non_argmax_gaps);
- the reference (``evaluate.lossless_reference``, plan.lossless_reference): the untrained draft's run, both
  speculative passes one prompt at a time so that every verification has the same 1 + k rows, compared exactly
  on each prompt where the trained draft's output is not token for token the one without speculation (where it
  is, it is lossless by definition); or the run without speculation, where ``evaluate.lossless_tie_steps``
  applies:
- with 0 steps (the default) no prompt may differ at all;
- with N > 0 steps a first divergence passes only as a tie: in both runs the two tokens' logits are within N steps
  of the logits' dtype at that magnitude (bf16 has 8 significant bits: at a logit of 20 one step is 0.125).
Every divergence is recorded, tie or not. docs/faults.md ("The lossless verdict") gives the reasoning."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from eagle3_workflow.files.draft_artefacts import LosslessMismatch
from eagle3_workflow.settings.errors import render_table

# significant bits after the leading one of each floating dtype the logits can come in
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "half": 10, "float32": 23, "float": 23, "auto": 7}
MAX_ARGMAX_EXAMPLES = 8


def first_divergence(expected: Sequence[int], found: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, found, strict=False)):
        if a != b:
            return i
    if len(expected) != len(found):
        return min(len(expected), len(found))
    return None


def dtype_step(magnitude: float, dtype: str) -> float:
    """The spacing of representable `dtype` values at `magnitude` (one unit in the last place)."""
    bits = MANTISSA_BITS.get(dtype, 7)
    magnitude = abs(magnitude)
    if magnitude == 0 or not math.isfinite(magnitude):
        return 2.0 ** (-126 - bits)
    return 2.0 ** (math.floor(math.log2(magnitude)) - bits)


def gap_in_steps(top: dict[int, float], winner: int | None, loser: int | None, dtype: str) -> float | None:
    """How many dtype steps `winner`'s logit is above `loser`'s in one step's top-k; None if either is missing."""
    if winner is None or loser is None or winner not in top or loser not in top:
        return None
    a, b = top[winner], top[loser]
    return (a - b) / dtype_step(max(abs(a), abs(b)), dtype)


def non_argmax_gaps(
    outputs: Sequence[Sequence[int]], top_logits: Sequence[Sequence[dict[int, float]]], dtype: str
) -> list[tuple[int, int, int, int, float, float, float]]:
    """Every (prompt, step) whose emitted token is not the highest logit of that step (exact ties pass): (prompt,
    position, emitted, argmax, emitted logit, argmax logit, gap in dtype steps at the argmax's magnitude)."""
    found = []
    for prompt, (tokens, steps) in enumerate(zip(outputs, top_logits, strict=True)):
        for position, (token, top) in enumerate(zip(tokens, steps, strict=False)):
            if top and token in top and top[token] < max(top.values()):
                best = max(top, key=top.__getitem__)
                gap = gap_in_steps(top, best, token, dtype) or 0.0
                found.append((prompt, position, token, best, top[token], top[best], gap))
    return found


def non_argmax_steps(
    outputs: Sequence[Sequence[int]], top_logits: Sequence[Sequence[dict[int, float]]], dtype: str
) -> list[str]:
    """Every (prompt, step) whose emitted token is not the highest logit of that step (ties pass), as text."""
    return [
        f"prompt {prompt} token {position}: emitted {token} (logit {logit:.4f}), argmax {best} (logit {top:.4f}), "
        f"{gap:.2f} {dtype} steps below it"
        for prompt, position, token, best, logit, top, gap in non_argmax_gaps(outputs, top_logits, dtype)
    ]


def compare_greedy(
    reference: tuple[Sequence[Sequence[int]], Sequence[Sequence[dict[int, float]]]],
    candidate: tuple[Sequence[Sequence[int]], Sequence[Sequence[dict[int, float]]]],
    *,
    origins: Sequence[str],
    dtype: str,
    tie_steps: int,
    decode: Callable[[Sequence[int]], str] = lambda ids: " ".join(map(str, ids)),
    context_tokens: int = 12,
) -> list[LosslessMismatch]:
    """The first divergence of each prompt whose candidate output differs from the reference. Each run is
    (outputs, top_logits): token ids per prompt, and per generated token the top-k raw logits."""
    mismatches = []
    reference_ids, reference_logits = reference
    candidate_ids, candidate_logits = candidate
    for index, (expected, found) in enumerate(zip(reference_ids, candidate_ids, strict=True)):
        position = first_divergence(expected, found)
        if position is None:
            continue
        expected_token = expected[position] if position < len(expected) else None
        found_token = found[position] if position < len(found) else None
        ref_top = _step(reference_logits, index, position)
        cand_top = _step(candidate_logits, index, position)
        reference_gap = gap_in_steps(ref_top, expected_token, found_token, dtype)
        candidate_gap = gap_in_steps(cand_top, found_token, expected_token, dtype)
        tie = (
            tie_steps > 0
            and reference_gap is not None
            and candidate_gap is not None
            and 0 <= reference_gap <= tie_steps
            and 0 <= candidate_gap <= tie_steps
        )
        mismatches.append(
            LosslessMismatch(
                prompt_index=index,
                origin=origins[index],
                position=position,
                expected_token=expected_token,
                found_token=found_token,
                reference_gap_steps=reference_gap,
                candidate_gap_steps=candidate_gap,
                tie=tie,
                context=decode(expected[max(0, position - context_tokens) : position]),
                expected_text=decode(expected[position : position + 8]) if expected_token is not None else "<end>",
                found_text=decode(found[position : position + 8]) if found_token is not None else "<end>",
            )
        )
    return mismatches


def _step(top_logits: Sequence[Sequence[dict[int, float]]], prompt: int, position: int) -> dict[int, float]:
    steps = top_logits[prompt] if prompt < len(top_logits) else []
    return steps[position] if position < len(steps) else {}


def _steps_text(gap: float | None) -> str:
    return "not in the top-k" if gap is None else f"{gap:.2f}"


REFERENCE_TEXT = {"no_speculation": "without speculation", "untrained": "with the untrained draft"}


def describe_mismatch(label: str, mismatch: LosslessMismatch, reference: str = "no_speculation") -> str:
    against = REFERENCE_TEXT.get(reference, reference)
    return (
        f"prompt {mismatch.prompt_index} ({mismatch.origin}), generated token {mismatch.position}:\n"
        f"  context:                 ...{mismatch.context!r}\n"
        f"  {against + ':':<24} {mismatch.expected_text!r} (token {mismatch.expected_token})\n"
        f"  with the {label} draft: {mismatch.found_text!r} (token {mismatch.found_token})\n"
        f"  logit gap in dtype steps: {_steps_text(mismatch.reference_gap_steps)} {against}, "
        f"{_steps_text(mismatch.candidate_gap_steps)} with the {label} draft"
    )


def lossless_failure(
    results: dict[str, list[LosslessMismatch]],
    non_argmax: dict[str, list[str]],
    *,
    num_prompts: int,
    tie_steps: int,
    numerics: str,
    reference: str = "no_speculation",
) -> str:
    """The StageError message: counts, the first real failure spelled out, then a table of every divergence.
    `results` holds each judged draft's first divergences from `reference`'s run."""
    parts = []
    counts = ", ".join(
        f"{sum(not m.tie for m in ms)}/{num_prompts} prompts with the {lbl} draft" for lbl, ms in results.items()
    )
    if reference == "none":
        against = "judged by the argmax check alone"
    else:
        against = f"against the run {REFERENCE_TEXT.get(reference, reference)}"
    if reference == "untrained":  # consulted only where the trained output differs from the one without speculation
        against += ", on the prompts where the output differs from the run without speculation"
    parts.append(
        f"speculative decoding changed the greedy output (not lossless, {numerics} kernels, {against}): {counts}."
    )
    for label, examples in non_argmax.items():
        if examples:
            shown = "\n  ".join(examples[:MAX_ARGMAX_EXAMPLES])
            parts.append(
                f"The {label} run emitted {len(examples)} token(s) that are not the argmax of its own logits (a "
                f"draft token accepted that the verifier did not choose):\n  {shown}"
            )
    first = next(((lbl, m) for lbl, ms in results.items() for m in ms if not m.tie), None)
    if first is not None:
        parts.append(f"First divergence that is not a tie:\n{describe_mismatch(*first, reference=reference)}")
    table = divergence_table(results)
    if table:
        parts.append(f"All first divergences (gaps in steps of the logits' dtype):\n{table}")
    parts.append(lossless_advice(reference, tie_steps))
    return "\n\n".join(parts)


def divergence_table(results: dict[str, list[LosslessMismatch]]) -> str:
    """Every judged draft's first divergences as a table ("" when there is none)."""
    rows = [
        (label, m.prompt_index, m.origin, m.position, m.expected_token, m.found_token,
         _steps_text(m.reference_gap_steps), _steps_text(m.candidate_gap_steps), "yes" if m.tie else "NO")
        for label, mismatches in results.items()
        for m in mismatches
    ]  # fmt: skip
    headers = ["draft", "prompt", "origin", "token", "expected", "found", "gap (ref)", "gap (spec)", "tie"]
    return render_table(headers, rows) if rows else ""


def lossless_advice(reference: str, tie_steps: int) -> str:
    """What a lossless failure against `reference` points at, and what to do."""
    if reference == "none":
        return (
            "EAGLE-3 verification must reproduce greedy decoding exactly. A token that is not its run's own argmax "
            "points at the spec-decode path of this vLLM (or the draft config). With evaluate.lossless_reference: "
            "none no other run is compared: see docs/faults.md, 'The lossless verdict'."
        )
    if reference == "untrained":
        return (
            "EAGLE-3 verification must reproduce greedy decoding exactly. A token that is not its run's own argmax "
            "points at the spec-decode path of this vLLM (or the draft config). Both speculative runs generated "
            "one prompt at a time, so each of their verification steps had the same 1 + k rows: the verifier's "
            "numerics were the same, and the only difference between the runs is which draft tokens it was "
            "shown. A verifier whose output depends on them (a wrong acceptance, a draft token leaking into the "
            "verified rows through the attention mask, positions or KV cache) is what this finds. One known "
            "exception is numerics: a target with multi-head latent attention (DeepSeek-V3, Kimi) is verified on "
            "CPU through vLLM's MLA prefill path, which splits each row's attention where its step starts, so "
            "acceptance changes the rounding; there evaluate.lossless_reference: none judges by the argmax check "
            "alone. See docs/faults.md, 'The lossless verdict'."
        )
    return (
        "EAGLE-3 verification must reproduce greedy decoding exactly. A token that is not its run's own argmax "
        "points at the spec-decode path of this vLLM (or the draft config). Divergences where both runs "
        f"emitted their own argmax are numerics: evaluate.lossless_numerics: batch_invariant (CUDA) removes "
        f"batch-composition effects; evaluate.lossless_tie_steps (now {tie_steps}) accepts ties within that "
        "many dtype steps after you have read them."
    )
