"""The draft parity check: vLLM's served draft proposes, step by step, what the trained draft proposes.

The canary proves that vLLM computes the *target* as an independent reference does; this proves the same of the
*draft*. The served run of a few evaluation prompts (the trained draft's engine, measure.parity_pass) records the
greedy output and how many tokens each engine step emitted (vLLM's DELTA outputs: the accepted draft tokens + the
bonus token; the prefill's first token alone). The reference (parity_reference) predicts every step from that
trajectory alone: speculators' own draft, built from the trainer's final checkpoint, run in fp32 on the hidden
states of the fp32 reference of the whole target (reference.full_depth), through vLLM's loop of proposals,
verification and bonus token.

What is compared: with the engine in the measurement process (CPU, and one GPU without async scheduling) the
draft's proposals of every step are read from vLLM's scheduler, and each is compared with the reference's while
the earlier ones equal the trajectory (the first rejected one included); otherwise each step's accepted count is.
A difference is excused only as a near-tie of the reference's own logits at that proposal: the gap between the
reference's top-1 and vLLM's token (or, where vLLM's token is unknown, the reference's top-2) within what the
served dtype's roundings can move it by (tie_bound: a probabilistic rounding-error bound from the dtype, the
number of roundings in series and the reference's own lm_head row and input; never fitted to runs).

The served draft's files are also compared with the trainer's checkpoint (config_differences: the config keys
that change what the draft computes, every tensor including d2t/t2d): a difference fails the check even where no
proposal moved beyond a tie. On the tiny preset's draft (64 wide, trained minutes) a rope_theta 100x larger or
smaller moves its first-step logits by at most 5.5 standard deviations of the rounding model (median 0.3,
measured on its 4 parity prompts, 2026-12-06) and no proposal beyond a tie: only the file comparison sees it there.
A flipped norm_before_residual moves them by up to 36 (10% of logits beyond 6), a shifted d2t or a
max_position_embeddings cut to 16 changes every step.

A failure names the first step that differs, the predicted and served proposals, the keys and tensors that
differ from the trainer's checkpoint, and every config key and vocabulary mapping that could explain it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.evaluation.lossless import dtype_step
from eagle3_workflow.evaluation.parity_reference import (
    Predicted,
    TrainedDraft,
    aux_states,
    load_reference_draft,
    predict,
    target_ids,
    trained_draft,
)
from eagle3_workflow.files.draft_artefacts import DraftParity, ParityDifference

log = logging.getLogger("eagle3.evaluation")

# what a served draft can get wrong that changes its proposals and no import check sees (faults.md)
CAUSES = [
    "norm_before_residual (config.json: vLLM's llama_eagle3 picks _norm_before_residual or _norm_after_residual)",
    "the d2t/t2d vocabulary mapping (model.safetensors: each draft id's target token)",
    "transformer_layer_config.max_position_embeddings (vLLM sizes the draft's rotary cache by it)",
    "transformer_layer_config.rope_theta / rope_parameters (the draft's rotary frequencies)",
    "eagle_aux_hidden_state_layer_ids (the target layers vLLM hands the draft)",
    "the draft's weights (model.safetensors other than the trainer's checkpoint)",
]
# the config keys compared between the served draft and the trainer's checkpoint (dotted: nested)
CONFIG_KEYS = [
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "draft_vocab_size",
    "eagle_aux_hidden_state_layer_ids",
    "transformer_layer_config.max_position_embeddings",
    "transformer_layer_config.rope_theta",
    "transformer_layer_config.rope_parameters",
    "transformer_layer_config.rope_scaling",
    "transformer_layer_config.hidden_size",
    "transformer_layer_config.num_attention_heads",
    "transformer_layer_config.num_key_value_heads",
    "transformer_layer_config.head_dim",
    "transformer_layer_config.rms_norm_eps",
    "transformer_layer_config.vocab_size",
]
# roundings of one pass of an EAGLE-3 draft in the served dtype, in series from its inputs to a logit (each kernel
# accumulates in fp32 and rounds its output once): per decoder layer its input norm(s), qkv, attention
# (softmax . V), o_proj, the residual add, the post-attention norm, gate/up, act x up, down, the residual add (the
# first layer's two input norms and fc counted as the norm), then the final norm
DRAFT_ROUNDINGS_PER_LAYER = 12
# per target decoder layer: its attention and MLP outputs are each rounded and added to the residual stream
TARGET_ROUNDINGS_PER_LAYER = 2
# a near-tie: the gap within this many standard deviations of what the roundings move it by (a healthy step
# outside it: probability ~6e-5 under the model below), plus one step for the logits' own rounding
TIE_SIGMAS = 4.0


def roundings(layer_ids: Sequence[int], proposal: int, num_draft_layers: int) -> int:
    """The served dtype's roundings in series between the target's embedding and proposal `proposal`'s (0-based)
    logits: the target's layers up to the deepest aux layer, then one draft pass per proposal (proposal t reads
    the draft's own output t times)."""
    draft_pass = DRAFT_ROUNDINGS_PER_LAYER * num_draft_layers + 1
    return TARGET_ROUNDINGS_PER_LAYER * (max(layer_ids, default=0) + 1) + draft_pass * (proposal + 1)


def tie_bound(head: Any, h: Any, winner: int, other: int, *, rounds: int, dtype: str, winner_logit: float) -> float:
    """How far (in logits) the served draft's gap logit(winner) - logit(other) may be from the fp32 reference's by
    the served dtype's rounding alone: the probabilistic rounding-error model (Higham and Mary, 2019). Each
    rounding moves an element x by an independent error, uniform within half a unit in the last place: standard
    deviation at most u|x|/sqrt(3), u = 2^-(mantissa bits + 1). A rounding of lm_head's input h moves the gap
    (W[winner] - W[other]) . h by a standard deviation of u/sqrt(3) |(W[winner] - W[other]) * h|; each of the
    `rounds` roundings in series is taken to move the residual stream as much, at first order and without
    amplification (RMSNorm takes magnitudes away), so the gap's deviation is sqrt(rounds) times that. A tie: within
    TIE_SIGMAS deviations, plus one step of the logit's magnitude for the two logits' own rounding.

    The model checked against real roundings (not fitted to them): the tiny preset's trained draft run by torch in
    bf16 on the fp32 aux states moved its top-1 gaps against every other token by a median 0.37, a 99th percentile
    1.33 and at most 2.47 of these deviations (143,080 gaps, its 4 parity prompts, 2026-12-06); vLLM's served
    draft on the same prompts differed from the reference only at two proposals, at 0.02 and 0.08 of their bounds."""
    from eagle3_workflow.evaluation.lossless import MANTISSA_BITS

    u = 2.0 ** -(MANTISSA_BITS.get(dtype, 7) + 1)
    spread = float(((head[winner] - head[other]) * h).norm())
    return TIE_SIGMAS * u / math.sqrt(3) * math.sqrt(rounds) * spread + dtype_step(winner_logit, dtype)


# ---------------------------------------------------------------------------------------------- the judgement


@dataclasses.dataclass
class Served:
    """One prompt's parity pass: its prompt ids, the served greedy output, the tokens each engine step emitted and
    (where the engine shows them) the draft's proposals made after each step, verified by the next."""

    prompt: list[int]
    output: list[int]
    steps: list[int]
    proposals: list[list[int]] | None = None


@dataclasses.dataclass
class Tally:
    compared: int = 0  # served steps
    agreeing: int = 0
    ties: int = 0
    proposals: int = 0  # served proposals compared one by one
    differences: list[ParityDifference] = dataclasses.field(default_factory=list)


def judge_parity(
    served: Sequence[Served],
    predicted: Sequence[Predicted],
    *,
    prompt_indices: Sequence[int],
    to_draft: dict[int, int],
    layer_ids: Sequence[int],
    dtype: str,
    decode: Callable[[Sequence[int]], str],
) -> Tally:
    """Each served step against the reference's prediction from that step's start.

    Where the served proposals are known, each is compared with the reference's while every earlier one equals
    the trajectory (the reference feeds the trajectory's tokens, vLLM its own proposals: the same tokens exactly
    then), the first rejected one included; else the step's accepted count is compared (the first proposal where
    the two differ: served accepted more, it proposed the trajectory's token; fewer, another one)."""
    tally = Tally()
    for index, run, pred in zip(prompt_indices, served, predicted, strict=True):
        trajectory = run.prompt + run.output
        k = len(pred.proposals)
        done = run.steps[0] if run.steps else 0  # the prefill's token: no proposal verified yet
        for step, emitted in enumerate(run.steps[1:], start=1):
            m = len(run.prompt) + done - 1  # the context ends at trajectory[m]
            remaining = len(run.output) - done
            reference = [pred.proposals[t][m - 1] for t in range(k)]
            wanted = trajectory[m + 1 : m + 1 + k]
            accepted_p = 0
            while accepted_p < min(k, len(wanted)) and reference[accepted_p] == wanted[accepted_p]:
                accepted_p += 1
            tally.compared += 1
            shown = run.proposals[step - 1] if run.proposals is not None and step - 1 < len(run.proposals) else []
            difference = proposal_difference(shown, reference, wanted, tally, decode)
            if difference is None and min(accepted_p + 1, remaining) != emitted:
                difference = count_difference(accepted_p, emitted - 1, wanted, decode)
            if difference is None:
                tally.agreeing += 1
            else:
                t, other, served_text = difference
                gap_steps, bound = gap_and_bound(pred, t, m - 1, other, to_draft=to_draft, layer_ids=layer_ids,
                                                 dtype=dtype)  # fmt: skip
                if gap_steps is not None and bound is not None and gap_steps <= bound:
                    tally.ties += 1
                else:
                    tally.differences.append(ParityDifference(
                        prompt_index=index, step=step, generated_position=done, proposal=t + 1,
                        predicted_accepted=min(accepted_p, remaining - 1), served_accepted=emitted - 1,
                        predicted_token=reference[t], predicted_text=decode([reference[t]]), served=served_text,
                        gap_steps=gap_steps, tie_bound_steps=bound,
                        context=decode(trajectory[max(0, m - 11) : m + 1]),
                    ))  # fmt: skip
            done += emitted
    return tally


Difference = tuple[int, int | None, str]  # the proposal (0-based), vLLM's token there (None: unknown), in words


def proposal_difference(
    shown: Sequence[int],
    reference: Sequence[int],
    wanted: Sequence[int],
    tally: Tally,
    decode: Callable[[Sequence[int]], str],
) -> Difference | None:
    """The first served proposal other than the reference's, compared while the earlier ones equal the trajectory
    (the reference feeds the trajectory's tokens: vLLM's are the same then), the first rejected one included."""
    for t in range(min(len(reference), len(shown), len(wanted))):
        tally.proposals += 1
        if shown[t] != reference[t]:
            return t, shown[t], f"{decode([shown[t]])!r} ({shown[t]})"
        if reference[t] != wanted[t]:
            return None
    return None


def count_difference(
    accepted_p: int, accepted_s: int, wanted: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> Difference:
    """The first proposal where a served accepted count other than the reference's says the two differ."""
    t = min(accepted_p, accepted_s)
    if accepted_s > accepted_p:  # vLLM proposed the trajectory's token, the reference another
        return t, wanted[t], f"{decode([wanted[t]])!r} ({wanted[t]}, accepted)"
    return t, None, f"not {decode([wanted[t]])!r} (rejected: not the target's {wanted[t]})"


def gap_and_bound(
    pred: Predicted,
    t: int,
    position: int,
    other: int | None,
    *,
    to_draft: dict[int, int],
    layer_ids: Sequence[int],
    dtype: str,
) -> tuple[float | None, float | None]:
    """The reference's logit gap between its proposal and vLLM's token (unknown: its own second choice) at that
    proposal, and tie_bound's, both in steps of the served dtype at the logit's magnitude; (None, None) when vLLM's
    token is outside the draft's vocabulary (never a tie)."""
    logits = pred.logits[t][position]
    best = int(logits.argmax())
    winner = float(logits[best])
    loser = int(logits.topk(2).indices[1]) if other is None else to_draft.get(other)
    if loser is None:
        return None, None
    step_size = dtype_step(winner, dtype)
    rounds = roundings(layer_ids, t, pred.num_draft_layers)
    bound = tie_bound(pred.head, pred.inputs[t][position], best, loser, rounds=rounds, dtype=dtype, winner_logit=winner)
    return (winner - float(logits[loser])) / step_size, bound / step_size


def config_differences(served_draft: Path, trained: TrainedDraft) -> list[str]:
    """The keys and mappings in which the served draft differs from the trainer's checkpoint, in words."""
    if not trained.independent:
        return []
    import torch
    from safetensors.torch import load_file

    served_cfg = json.loads((served_draft / "config.json").read_text())
    trained_cfg = json.loads((trained.checkpoint / "config.json").read_text())
    found = []
    for key in CONFIG_KEYS:
        a, b = _dotted(served_cfg, key), _dotted(trained_cfg, key)
        if a != b:
            found.append(f"{key}: served {a!r}, trained {b!r}")
    served_ids = served_cfg.get("eagle_aux_hidden_state_layer_ids")
    checkpoint_ids = trained_cfg.get("eagle_aux_hidden_state_layer_ids")
    if served_ids is not None and served_ids == checkpoint_ids and list(served_ids) != list(trained.layer_ids):
        found.append(f"eagle_aux_hidden_state_layer_ids: served {served_ids}, trained on {trained.layer_ids}")
    served_w = load_file(str(served_draft / "model.safetensors"))
    trained_w = load_file(str(trained.checkpoint / "model.safetensors"))
    for name in sorted(served_w.keys() | trained_w.keys()):
        a, b = served_w.get(name), trained_w.get(name)
        if a is None or b is None or a.shape != b.shape or not torch.equal(a, b):
            what = "vocabulary mapping" if name in ("d2t", "t2d") else "tensor"
            found.append(f"{what} {name}: the served model.safetensors differs from the trainer's checkpoint")
    return list(dict.fromkeys(found))


def _dotted(config: dict[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} dtype steps"


def parity_failure(parity: DraftParity, *, draft: str) -> str:
    """The StageError text of a failed parity check: the first difference, the suspects, the escape hatch."""
    first = parity.first_difference
    if parity.differing_steps:
        head = (
            f"vLLM's served draft does not propose what the trained draft proposes ({parity.differing_steps} of "
            f"{parity.steps_compared} steps differ beyond a near-tie, {parity.ties_excused} excused as ties)"
        )
    else:
        head = (
            f"the served draft's files are not the trainer's checkpoint (its {parity.steps_compared} served steps "
            f"agree with the trained draft's prediction, {parity.ties_excused} as near-ties: on these prompts the "
            "change moves no proposal beyond what rounding can)"
        )
    lines = [f"draft parity FAILED for {draft}: {head}; reference: {parity.reference}."]  # fmt: skip
    if first is not None:
        gap = (
            "none: vLLM's token is not in the draft's vocabulary"
            if first.gap_steps is None
            else _steps(first.gap_steps)
        )
        lines.append(
            f"first difference: prompt {first.prompt_index}, step {first.step} (generated token {first.generated_position}), "
            f"proposal {first.proposal}: predicted {first.predicted_text!r} ({first.predicted_token}), served "
            f"{first.served}; accepted predicted {first.predicted_accepted}, served {first.served_accepted}; "
            f"the reference's logit gap {gap} (a tie only within {_steps(first.tie_bound_steps)}, from the rounding model); context {first.context!r}"
        )  # fmt: skip
    if parity.config_differences:
        lines.append(
            "the served draft differs from the trainer's checkpoint in: " + "; ".join(parity.config_differences)
        )
    lines.append(
        "what could explain it (check the served draft/ against the trainer's checkpoint): " + "; ".join(CAUSES)
    )
    lines.append("Fix the served draft's files (or vLLM's reading of them); evaluate.draft_parity_prompts: 0 turns "
                 "the check off (unsafe: recorded in acceptance.json).")  # fmt: skip
    return "\n".join(lines)


def check_parity(
    served: Sequence[Served],
    *,
    prompt_indices: Sequence[int],
    draft: Path,
    target: Path,
    k: int,
    dtype: str,
    trust_remote_code: bool,
    decode: Callable[[Sequence[int]], str],
    reference_device: str,
) -> DraftParity:
    """The parity check of the served draft: the reference predicted on the served trajectories, judged."""
    trained = trained_draft(draft)
    model = load_reference_draft(trained, target)
    trajectories = [s.prompt + s.output for s in served]
    states = aux_states(target, trajectories, trained.layer_ids, trust_remote_code=trust_remote_code,
                        device=reference_device)  # fmt: skip
    predicted = [predict(model, aux, trajectory, k) for aux, trajectory in zip(states, trajectories, strict=True)]
    to_target = target_ids(model)
    to_draft = {t: d for d, t in enumerate(to_target)}
    tally = judge_parity(served, predicted, prompt_indices=prompt_indices, to_draft=to_draft,
                         layer_ids=trained.layer_ids, dtype=dtype, decode=decode)  # fmt: skip
    differences = tally.differences
    files = config_differences(draft, trained)
    verdict = "failed" if differences or files else "passed" if tally.compared else "not judged"
    return DraftParity(
        verdict=verdict,
        prompts=list(prompt_indices),
        steps_compared=tally.compared,
        agreeing_steps=tally.agreeing,
        ties_excused=tally.ties,
        differing_steps=len(differences),
        proposals_compared=tally.proposals,
        dtype=dtype,
        roundings=[roundings(trained.layer_ids, t, len(model.layers)) for t in range(k)],
        tie_sigmas=TIE_SIGMAS,
        reference=trained.source,
        independent=trained.independent,
        first_difference=differences[0] if differences else None,
        config_differences=files,
    )


def draft_parity(
    trained: Any,
    prompt_set: Any,
    *,
    draft: Path,
    target: Path,
    k: int,
    dtype: str,
    trust_remote_code: bool,
    decode: Callable[[Sequence[int]], str],
    reference_device: str,
) -> DraftParity:
    """The stage's step: the trained draft's parity pass (a RunResult) judged; "off" without one."""
    if not trained.parity_steps:
        return DraftParity(verdict="off", prompts=[], steps_compared=0, agreeing_steps=0, ties_excused=0,
                           differing_steps=0, dtype=dtype, roundings=[], tie_sigmas=TIE_SIGMAS, reference="",
                           independent=False)  # fmt: skip
    n = len(trained.parity_steps)
    proposals = trained.parity_proposals or [None] * n
    served = [Served(prompt=list(p.token_ids), output=list(o), steps=list(s), proposals=q)
              for p, o, s, q in zip(prompt_set.prompts[:n], trained.parity_outputs, trained.parity_steps, proposals,
                                    strict=True)]  # fmt: skip
    parity = check_parity(served, prompt_indices=list(range(n)), draft=draft, target=target, k=k, dtype=dtype,
                          trust_remote_code=trust_remote_code, decode=decode,
                          reference_device=reference_device)  # fmt: skip
    if not parity.independent:
        log.warning("draft parity: %s", parity.reference)
    log.info("draft parity %s: %d of %d served steps agree with the trained draft's prediction, %d excused as ties "
             "(reference: %s)", parity.verdict, parity.agreeing_steps, parity.steps_compared, parity.ties_excused,
             parity.reference)  # fmt: skip
    return parity
