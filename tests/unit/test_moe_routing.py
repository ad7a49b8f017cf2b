"""The error rule of both reference gates on mixture-of-experts targets (eagle3_workflow.reference.layer_match): the router margin
and its bf16 bound on synthetic tensors, which tokens a near-tied routing excuses (and that a dense target's row is
exactly the per-token maximum it always was), and the no-silent-weaker-proof rule at check_api. The canary on a real
MoE target through vLLM: tests/integration/test_gates_canary.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import api_report

from eagle3_workflow.reference.layer_match import (
    BF16_ROUNDING,
    MAX_EXCUSED_FRACTION,
    ROUTING_DRIFT,
    ROUTING_SIGMAS,
    SlotComparison,
    excused_tokens,
    topk_gap_and_bound,
)


def test_the_gap_is_between_the_kth_and_the_next_selection_score():
    """Sigmoid scoring with a correction bias (DeepSeek-V3/Kimi-K2), top-2 of 4: the gap and the bound by hand."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.999, 0.0], [-1.0, 0.5]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.3])
    gap, bound = topk_gap_and_bound(x, weight, 2, bias=bias, sigmoid=True)
    s = torch.sigmoid(torch.tensor([1.0, 0.999]))
    assert gap[0] == pytest.approx(float(s[0] - s[1]), abs=1e-7)  # experts 1 and 2: a near tie
    slope = s * (1 - s)
    rounding = BF16_ROUNDING * float(slope[0] * 1.0 + slope[1] * 0.999)
    deviation = ROUTING_SIGMAS * ROUTING_DRIFT * 1.0 * float((slope[0] - slope[1] * 0.999).abs()) / math.sqrt(2)
    assert bound[0] == pytest.approx(rounding + deviation, rel=1e-5)
    assert bool(gap[0] < bound[0]), "a 0.0002 score gap is within bf16's reach"
    assert gap[1] == 0 and bool(gap[1] < bound[1]), "token 1: experts 0, 1, 2 tie at sigmoid(0) behind expert 3"


def test_a_clear_winner_is_not_ambiguous_and_softmax_routers_compare_logits():
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    weight = torch.randn(8, 128) * 0.05
    weight[3] *= 40  # expert 3 dominates for tokens along it
    x[:32] = weight[3] / weight[3].norm() * 11.3 + 0.01 * x[:32]
    gap, bound = topk_gap_and_bound(x, weight, 1)
    logits = x @ weight.T
    top = logits.topk(2, dim=-1).values
    assert torch.allclose(gap, top[:, 0] - top[:, 1])
    assert not bool((gap[:32] < bound[:32]).any()), "expert 3 wins by far: never ambiguous"
    # exact ties are always ambiguous, whatever the bound's size
    tied = torch.cat([weight[:1], weight[:1], weight[2:]])
    gap, bound = topk_gap_and_bound(x, tied, 1)
    first_two = (x @ tied.T).topk(1, dim=-1).indices[:, 0] <= 1
    assert bool((gap[first_two] < bound[first_two]).all() or (gap[first_two] == 0).all())


def test_group_limited_routing_only_counts_the_selected_groups():
    """n_group 2, topk_group 1: the (k+1)-th expert of the other group cannot take the k-th's place."""
    x = torch.tensor([[1.0]])
    weight = torch.tensor([[3.0], [2.0], [1.99], [0.0]])  # group 0: experts 0, 1; group 1: experts 2, 3
    gap, _ = topk_gap_and_bound(x, weight, 2, bias=torch.zeros(4), sigmoid=True, groups=2, topk_groups=1)
    assert math.isinf(float(gap[0])), "experts 0 and 1 are selected; expert 2's group was not"


class Probe:
    """A RoutingProbe stand-in with set ambiguity: routing only; the comparison itself is the real one."""

    def __init__(self, ambiguous):
        self.ambiguous = ambiguous

    def visited(self, *_):
        pass

    def upstream(self, layer_id, sample, tokens):
        flagged = torch.zeros(tokens, dtype=torch.bool)
        for layer, mask in self.ambiguous.items():
            if layer < layer_id:
                flagged |= mask[sample, :tokens]
        return flagged


def comparison_with_one_bad_token(ambiguous_at: dict[int, list[int]], tokens: int = 40, bad: tuple = (7,)):
    """Slot id 2 of one sample equals its reference but for the tokens `bad` (off by 0.2 of max |ref|)."""
    torch.manual_seed(1)
    ref = torch.randn(1, tokens, 16)
    got = ref[0].clone()
    for t in bad:
        got[t] += 0.2 * ref.abs().max()
    comparison = SlotComparison([got[:, None, :]], [2])
    masks = {layer: torch.zeros(1, tokens, dtype=torch.bool) for layer in ambiguous_at}
    for layer, toks in ambiguous_at.items():
        masks[layer][0, toks] = True
    comparison.routing = Probe(masks)
    comparison("2", ref)
    return comparison


def test_a_token_above_tolerance_is_excused_only_when_routed_near_a_tie_upstream():
    dense = comparison_with_one_bad_token({}).errors(0.05)["2"]
    assert dense.max_rel == dense.raw_max_rel == pytest.approx(0.2, rel=1e-5), "no router: the plain maximum"
    assert dense.excused == dense.ambiguous == 0
    moe = comparison_with_one_bad_token({1: [7, 20]}).errors(0.05)["2"]
    assert moe.excused == 1 and moe.ambiguous == 2, "token 20 is ambiguous but within tolerance: not excused"
    assert moe.max_rel < 1e-6 and moe.raw_max_rel == pytest.approx(0.2, rel=1e-5) and moe.excused_ok
    elsewhere = comparison_with_one_bad_token({1: [20]}).errors(0.05)["2"]
    assert elsewhere.max_rel == pytest.approx(0.2, rel=1e-5), "another token's tie excuses nothing"
    downstream = comparison_with_one_bad_token({2: [7], 5: [7]}).errors(0.05)["2"]
    assert downstream.max_rel == pytest.approx(0.2, rel=1e-5), "a tie at layer 2 or later cannot move id 2"


def test_more_excused_tokens_than_the_cap_is_not_a_routing_tie():
    bad = tuple(range(0, 40, 8))  # 5 of 40 tokens off: 12.5% > the cap
    assert len(bad) > MAX_EXCUSED_FRACTION * 40
    row = comparison_with_one_bad_token({1: list(bad)}, bad=bad).errors(0.05)["2"]
    assert row.excused == len(bad) and not row.excused_ok


def test_excused_tokens_is_exactly_ambiguous_and_above_tolerance():
    per_token = torch.tensor([0.01, 0.2, 0.2, 0.01])
    ambiguous = torch.tensor([True, True, False, False])
    assert excused_tokens(per_token, ambiguous, 0.05).tolist() == [False, True, False, False]


def test_the_full_depth_check_sees_moe_routing_and_none_on_a_dense_target(tmp_path):
    """Through the real streamed reference: DeepSeek-V3's routers are found (every MoE layer of the batch, so some
    tokens are ambiguous), a llama has none; a right capture passes both."""
    from test_full_depth import SAMPLES, random_target, write_capture

    from eagle3_workflow.validation.full_depth import full_depth_check

    samples = {0: SAMPLES[0], 1: SAMPLES[1]}
    for arch, moe in (("deepseek_v3", True), ("llama", False)):
        target = random_target(tmp_path / arch, arch, 4)
        write_capture(tmp_path / arch / "files", target, samples, [2, 4], {})
        report = full_depth_check(target, tmp_path / arch / "files", samples, [2, 4], tolerance=0.05, max_tokens=64,
                                  trust_remote_code=False, device="cpu")  # fmt: skip
        assert report.passed and report.proof == "hf_fp32"
        ambiguous = sum(s.ambiguous_tokens for s in report.slots)
        assert (ambiguous > 0) is moe, (arch, [s.model_dump() for s in report.slots])
        assert all(s.tokens == 52 for s in report.slots)


# ---------------------------------------------------------------- no silent weaker proof


def test_check_api_refuses_a_target_the_canary_reference_cannot_run(tiny_targets, tmp_path):
    """A checkpoint that lacks a layer's tensors: the canary's fp32 reference cannot be built, check_api fails its
    `canary reference` row with the cause and the fix, also with the full-depth check off; asked for, the weaker
    self-consistency proof is what the row says."""
    from eagle3_workflow.api_checks.checks import failure_advice

    target = tmp_path / "model"
    target.mkdir()
    for path in tiny_targets("llama").iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 9  # the checkpoint holds layers 0..7
    (target / "config.json").write_text(json.dumps(config))
    report = api_report(target, full_depth_check=False)
    row = next(r for r in report.checks if r.name == "canary reference")
    assert not report.passed and not row.passed
    assert "no tensor of decoder layers [8]" in row.found
    advice = failure_advice([row])
    assert "canary.reference: self_consistency" in advice and "weaker" in advice
    weaker = api_report(target, full_depth_check=False, canary_reference="self_consistency")
    row = next(r for r in weaker.checks if r.name == "canary reference")
    assert row.passed and "not checked" in row.found and "self_consistency" in row.found
