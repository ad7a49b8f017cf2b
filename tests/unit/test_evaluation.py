"""evaluate_draft's pure parts: the metric math, the held-out selection, the lossless diff, the engine settings,
the import boundary of its modules and the untrained baseline. The measurement process and the rule for real:
tests/integration/test_evaluation_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, evaluation, shift_d2t, tiny_settings
from synthetic_run import build_scratch_draft

from eagle3_workflow.evaluation.baseline import build_untrained_draft
from eagle3_workflow.evaluation.launch import measurement_engine_kwargs, measurement_environment
from eagle3_workflow.evaluation.lossless import (
    compare_greedy,
    describe_mismatch,
    dtype_step,
    first_divergence,
    lossless_failure,
    non_argmax_steps,
)
from eagle3_workflow.evaluation.metrics import (
    SpecDecodeCounters,
    acceptance_from_counters,
    counters_delta,
    counters_from_metrics,
)
from eagle3_workflow.evaluation.prompts import (
    PromptCandidate,
    file_candidates,
    heldout_rows,
    load_prompts,
    prompt_messages,
    select_prompts,
)
from eagle3_workflow.evaluation.protocol import eagle3_run
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ServingStage

VLLM_SETTINGS = tiny_settings(ServingStage).vllm  # the vllm section of a tiny run (CPU)


def counter(name: str, value: int, engine: str = "0") -> dict:
    return {"name": f"vllm:spec_decode_{name}", "labels": {"engine": engine}, "value": value, "values": []}


def per_position(values: list[int], engine: str = "0") -> dict:
    return {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "labels": {"engine": engine}, "value": None,
            "values": values}  # fmt: skip


# ---------------------------------------------------------------- metric math


def test_counters_are_summed_over_engines():
    snapshot = [counter("num_drafts", 10), counter("num_draft_tokens", 30), counter("num_accepted_tokens", 12),
                per_position([7, 4, 1]), counter("num_drafts", 5, "1"), counter("num_draft_tokens", 15, "1"),
                counter("num_accepted_tokens", 3, "1"), per_position([2, 1, 0], "1"),
                {"name": "vllm:num_requests_running", "labels": {}, "value": 0, "values": []}]  # fmt: skip
    assert counters_from_metrics(snapshot) == SpecDecodeCounters(15, 45, 15, [9, 5, 1])


def test_no_spec_counters_means_none():
    assert counters_from_metrics([{"name": "vllm:num_requests_running", "labels": {}, "value": 0}]) is None


def test_delta_removes_the_warmup():
    before = SpecDecodeCounters(2, 6, 1, [1, 0, 0])
    after = SpecDecodeCounters(12, 36, 13, [8, 4, 1])
    assert counters_delta(before, after) == SpecDecodeCounters(10, 30, 12, [7, 4, 1])
    assert counters_delta(None, after) == after


def test_acceptance_length_counts_the_bonus_token():
    stats = acceptance_from_counters(SpecDecodeCounters(10, 30, 12, [7, 4, 1]), 3)
    assert stats.mean_acceptance_length == pytest.approx(2.2)
    assert stats.per_position_acceptance == pytest.approx([0.7, 0.4, 0.1])
    assert stats.draft_acceptance_rate == pytest.approx(0.4)
    # nothing accepted = one token per step, and a short vector is padded to k positions
    stats = acceptance_from_counters(SpecDecodeCounters(10, 30, 0, []), 3)
    assert stats.mean_acceptance_length == 1.0
    assert stats.per_position_acceptance == [0.0, 0.0, 0.0]


def test_no_drafts_is_a_failure_not_a_division_by_zero():
    with pytest.raises(StageError, match="proposed no drafts"):
        acceptance_from_counters(SpecDecodeCounters(0, 0, 0, []), 3)


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize(("rows", "ratio", "expected"), [(256, 0.95, range(243, 256)), (10, 0.5, range(5, 10)),
                                                         (64, 0.9, range(57, 64)), (5, 0.99, range(4, 5))])  # fmt: skip
def test_heldout_rows_are_the_trainers_validation_split(rows, ratio, expected):
    assert heldout_rows(rows, ratio) == expected
    # speculators.train.data.ArrowDataset: split_idx = int(len(self.data) * train_ratio); val = [split_idx, len)
    assert heldout_rows(rows, ratio).start == int(rows * ratio)


def test_prompt_is_the_conversation_up_to_its_last_user_turn():
    conversation = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": "a2"}]  # fmt: skip
    assert prompt_messages(conversation) == conversation[:4]
    assert prompt_messages([{"role": "assistant", "content": "a"}]) is None


def test_select_prompts_skips_unusable_and_long_ones_and_stops_at_the_count():
    candidates = [PromptCandidate("a", [{"role": "user", "content": "x" * 3}]),
                  PromptCandidate("b", None, "no user turn"),
                  PromptCandidate("c", [{"role": "user", "content": "x" * 50}]),
                  PromptCandidate("d", [{"role": "user", "content": "x" * 5}]),
                  PromptCandidate("e", [{"role": "user", "content": "x" * 6}])]  # fmt: skip
    chosen, skipped = select_prompts(candidates, lambda m: list(range(len(m[0]["content"]))), num_prompts=2,
                                     max_prompt_tokens=10)  # fmt: skip
    assert [p.origin for p in chosen] == ["a", "d"]
    assert skipped == {"no user turn": 1, "longer than max_model_len - max_tokens": 1}


def test_prompt_files_in_every_accepted_shape(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join([
        json.dumps("plain string"), json.dumps({"prompt": "from prompt"}),
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        json.dumps({"conversations": [{"from": "human", "value": "hi"}]}), "",
    ]))  # fmt: skip
    candidates, detail = file_candidates(jsonl)
    assert [c.messages for c in candidates] == [
        [{"role": "user", "content": "plain string"}], [{"role": "user", "content": "from prompt"}],
        [{"role": "user", "content": "q"}], [{"role": "user", "content": "hi"}],
    ]  # fmt: skip
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [c.origin for c in file_candidates(txt)[0]] == ["p.txt:1", "p.txt:3"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(StageError, match="bad.jsonl:1: not JSON"):
        file_candidates(tmp_path / "bad.jsonl")


def test_heldout_prompts_render_with_the_chat_template_and_say_when_short(prepared, tiny_tokenizer):
    settings = evaluation(prompts="heldout", num_prompts=10, max_tokens=32)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=prepared["prepared"], train_data_ratio=0.9,
                              max_model_len=512)  # fmt: skip
    assert len(prompt_set.prompts) == 7  # rows 57..63 of 64
    assert prompt_set.prompts[0].origin.startswith("row 57 (")
    assert "only 7 usable prompts of the 10 requested" in " ".join(prompt_set.notes)
    text = tiny_tokenizer.decode(prompt_set.prompts[0].token_ids)
    assert text.startswith("<|begin_of_text|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_humaneval_prompts_come_from_the_package(tiny_tokenizer, tmp_path):
    settings = evaluation(prompts="humaneval", num_prompts=3, max_tokens=32)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=tmp_path, train_data_ratio=0.9,
                              max_model_len=4096)  # fmt: skip
    assert [p.origin for p in prompt_set.prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def " in tiny_tokenizer.decode(prompt_set.prompts[0].token_ids)


def test_no_heldout_rows_fails_with_the_fix(prepared, tiny_tokenizer):
    with pytest.raises(StageError, match="train.train_data_ratio"):
        load_prompts(evaluation(max_tokens=32), tiny_tokenizer, prepared_dir=prepared["prepared"],
                     train_data_ratio=1.0, max_model_len=512)  # fmt: skip


# ---------------------------------------------------------------- lossless check


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # one stopped early


def test_dtype_step_is_the_spacing_of_bf16_values_at_that_magnitude():
    assert dtype_step(1.0, "bfloat16") == 2**-7
    assert dtype_step(20.0, "bfloat16") == 0.125  # 16 <= 20 < 32: 2**4 * 2**-7
    assert dtype_step(-20.0, "bfloat16") == 0.125
    assert dtype_step(20.0, "float32") == 2**-19
    assert dtype_step(20.0, "float16") == 2**-6


def test_exact_mode_fails_every_divergence_and_records_both_runs_gaps():
    reference = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    candidate = [[1, 2, 3, 4], [5, 9, 9], [8]]
    ref_logits = [[{}] * 4, [{5: 10.0}, {6: 20.0, 9: 20.0}, {7: 3.0}], [{8: 1.0}, {9: 1.0}]]
    cand_logits = [[{}] * 4, [{5: 10.0}, {9: 20.0, 6: 20.0}, {9: 3.0}], [{8: 1.0}]]
    found = compare_greedy((reference, ref_logits), (candidate, cand_logits), origins=["a", "b", "c"],
                           dtype="bfloat16", tie_steps=0)  # fmt: skip
    assert [(m.prompt_index, m.position, m.expected_token, m.found_token) for m in found] == [(1, 1, 6, 9),
                                                                                              (2, 1, 9, None)]  # fmt: skip
    assert found[0].reference_gap_steps == 0.0
    assert found[0].candidate_gap_steps == 0.0
    assert not found[0].tie  # exact: even an exact tie of logits is recorded as a divergence that fails
    assert found[1].reference_gap_steps is None
    assert not found[1].tie
    assert found[1].found_text == "<end>"


def test_a_tie_passes_only_within_the_stated_steps_in_both_runs():
    reference, candidate = [[5, 6]], [[5, 9]]

    def judge(ref_top, cand_top, steps):
        ref_logits, cand_logits = [[{5: 1.0}, ref_top]], [[{5: 1.0}, cand_top]]
        return compare_greedy((reference, ref_logits), (candidate, cand_logits), origins=["a"], dtype="bfloat16",
                              tie_steps=steps)[0]  # fmt: skip

    # at a logit of ~20 a bf16 step is 0.125: one step apart in each run, each run's own argmax
    one_step = judge({6: 20.125, 9: 20.0}, {9: 20.125, 6: 20.0}, 1)
    assert one_step.reference_gap_steps == pytest.approx(1.0)
    assert one_step.candidate_gap_steps == pytest.approx(1.0)
    assert one_step.tie
    assert not judge({6: 20.125, 9: 20.0}, {9: 20.125, 6: 20.0}, 0).tie  # exact mode
    assert not judge({6: 20.5, 9: 20.0}, {9: 20.125, 6: 20.0}, 2).tie  # 4 steps in the reference
    # the speculative run did not emit its own argmax at the divergence: a wrong acceptance, never a tie
    wrong = judge({6: 20.125, 9: 20.0}, {6: 20.125, 9: 20.0}, 8)
    assert wrong.candidate_gap_steps == pytest.approx(-1.0)
    assert not wrong.tie
    assert not judge({6: 20.125}, {9: 20.125, 6: 20.0}, 8).tie  # a token outside the reference's top-k


def test_a_token_that_is_not_its_runs_argmax_is_named():
    outputs = [[3, 4], [5]]
    top_logits = [[{3: 2.0, 8: 1.0}, {4: 1.0, 7: 1.5}], [{5: 0.5, 6: 0.5}]]  # an exact tie passes
    # the margin: 0.5 below the argmax at a magnitude of 1.5, where a bf16 step is 2**-7
    assert non_argmax_steps(outputs, top_logits, "bfloat16") == [
        "prompt 0 token 1: emitted 4 (logit 1.0000), argmax 7 (logit 1.5000), 64.00 bfloat16 steps below it"
    ]


def test_lossless_failure_shows_the_first_real_divergence_and_wrong_acceptances_readably():
    mismatches = compare_greedy(([[10, 11, 12]], [[{10: 0.0}, {11: 0.0}, {12: 2.0, 99: -2.0}]]),
                                ([[10, 11, 99]], [[{10: 0.0}, {11: 0.0}, {12: 2.0, 99: -2.0}]]),
                                origins=["data.jsonl:7"], dtype="bfloat16", tie_steps=0,
                                decode=lambda ids: "".join(chr(96 + i % 26) for i in ids))  # fmt: skip
    wrong = ["prompt 0 token 2: emitted 99 (logit -2.0000), argmax 12 (logit 2.0000)"]
    message = lossless_failure({"trained": mismatches, "untrained": []}, {"trained": wrong, "untrained": []},
                               num_prompts=4, tie_steps=0, numerics="batch_invariant")  # fmt: skip
    assert "1/4 prompts with the trained draft, 0/4 prompts with the untrained draft" in message
    assert "batch_invariant kernels" in message
    assert "not the argmax of its own logits" in message
    assert wrong[0] in message
    assert "data.jsonl:7" in message
    assert "token 12" in message
    assert "token 99" in message
    assert "256.00" in message  # 4.0 apart at magnitude 2 (bf16 step 2**-6)
    assert describe_mismatch("trained", mismatches[0]) in message


def _lossless_run(label: str, outputs: list[list[int]], top_logits: list[list[dict[int, float]]]):
    from eagle3_workflow.evaluation.protocol import RunResult

    metrics = [counter("num_drafts", 10), counter("num_draft_tokens", 30), counter("num_accepted_tokens", 3),
               per_position([2, 1, 0])] if label != "no_speculation" else []  # fmt: skip
    return RunResult(label=label, engine_start_s=1.0, generate_s=1.0, generated_tokens=sum(map(len, outputs)),
                     outputs=outputs, finish_reasons=["stop"] * len(outputs), top_logits=top_logits,
                     metrics_before=[], metrics_after=metrics, load_1m=0.0)  # fmt: skip


def _judge(runs: dict[str, tuple[list[list[int]], list[list[dict[int, float]]]]], reference: str, tie_steps: int = 0):
    """lossless_verdict and draft_results on hand-made runs of 2 prompts: each draft's AcceptanceResult."""
    from eagle3_workflow.evaluation.judge import draft_results, lossless_verdict
    from eagle3_workflow.evaluation.measurements import Measured
    from eagle3_workflow.evaluation.prompts import EvalPrompt, PromptSet

    lossless = {label: _lossless_run(label, *run) for label, run in runs.items()}
    prompt_set = PromptSet(prompts=[EvalPrompt(token_ids=[1], origin=f"row {i}") for i in range(2)], source="heldout",
                           requested=2, detail="test", notes=[])  # fmt: skip
    verdict = lossless_verdict(lossless, prompt_set, logit_dtype="bfloat16", tie_steps=tie_steps,
                               numerics="production", decode=str, reference=reference)  # fmt: skip
    measured = Measured(lossless=lossless, timing=dict(lossless), processes=[])
    return verdict, draft_results(measured, verdict, {"trained": Path("t"), "untrained": Path("u")}, 3)


# each step's top logits: the emitted token one bf16 step (0.125 at ~20) above the other of a near-tie pair
A, B = {7: 20.125, 8: 20.0}, {8: 20.125, 7: 20.0}
SPECULATIVE = ([[1, 2, 7, 3], [4, 5]], [[{1: 9.0}, {2: 9.0}, A, {3: 9.0}], [{4: 9.0}, {5: 9.0}]])
# the run without speculation (one row a step) flipped the near-tie of prompt 0 at token 2, its own argmax
NO_SPECULATION = ([[1, 2, 8, 3], [4, 5]], [[{1: 9.0}, {2: 9.0}, B, {3: 9.0}], [{4: 9.0}, {5: 9.0}]])


def test_the_untrained_reference_is_exact_and_records_the_run_without_speculation_unjudged():
    """Trained equal to untrained token for token: lossless, whatever the run without speculation did at a near-tie
    (recorded with its gaps, not judged); one token apart where both are their run's argmax: fails (no tie
    allowance there)."""
    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": SPECULATIVE, "untrained": SPECULATIVE},
                              reference="untrained")  # fmt: skip
    assert verdict.reference == "untrained"
    assert verdict.judged() == {"trained": []}
    assert results["trained"].lossless and results["untrained"].lossless
    assert results["trained"].mismatches == []
    recorded = results["trained"].no_speculation_divergences
    assert [(m.prompt_index, m.position, m.expected_token, m.found_token) for m in recorded] == [(0, 2, 8, 7)]
    assert recorded[0].reference_gap_steps == pytest.approx(1.0) and recorded[0].candidate_gap_steps == pytest.approx(
        1.0
    )
    assert results["untrained"].no_speculation_divergences == recorded
    assert results["trained"].non_argmax_min_gap_steps is None
    assert verdict.criterion.startswith("exact") and "one prompt at a time" in verdict.criterion

    # the trained draft's output equal to the one without speculation token for token: lossless by definition,
    # whatever the untrained draft's run did there (it is the reference only where the two differ)
    flipped = ([[1, 2, 8, 3], [4, 5]], [[{1: 9.0}, {2: 9.0}, B, {3: 9.0}], [{4: 9.0}, {5: 9.0}]])
    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": flipped, "untrained": SPECULATIVE},
                              reference="untrained")  # fmt: skip
    assert results["trained"].lossless and verdict.judged() == {"trained": []}
    assert results["trained"].no_speculation_divergences == []
    # a near-tie flipped between the two speculative runs where the output differs from the one without
    # speculation: exact, so it fails, with both gaps shown
    verdict, results = _judge({"no_speculation": SPECULATIVE, "trained": flipped, "untrained": SPECULATIVE},
                              reference="untrained")  # fmt: skip
    assert not results["trained"].lossless and results["untrained"].lossless
    (found,) = results["trained"].mismatches
    assert (found.position, found.expected_token, found.found_token, found.tie) == (2, 7, 8, False)
    message = lossless_failure(verdict.judged(), verdict.non_argmax, num_prompts=2, tie_steps=0,
                               numerics="production", reference="untrained")  # fmt: skip
    assert ("against the run with the untrained draft, on the prompts where the output differs from the run "
            "without speculation): 1/2 prompts with the trained draft.") in message  # fmt: skip
    assert "  with the untrained draft: '[7, 3]' (token 7)" in message and "with the trained draft: '[8, 3]'" in message
    assert "1.00 with the untrained draft, 1.00 with the trained draft" in message
    # no reference (MLA targets on CPU): the same flip recorded, not judged; the argmax check still judges
    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": flipped, "untrained": SPECULATIVE},
                              reference="none")  # fmt: skip
    assert results["trained"].lossless and results["trained"].mismatches == []
    assert [(m.position, m.expected_token, m.found_token) for m in results["trained"].untrained_divergences] == [
        (2, 7, 8)]  # fmt: skip
    assert verdict.criterion.startswith("every emitted token of every run is its own argmax")
    # against no speculation with the same tie allowance the same runs would pass: the reference decides
    _, results = _judge({"no_speculation": SPECULATIVE, "trained": flipped, "untrained": SPECULATIVE},
                        reference="no_speculation", tie_steps=1)  # fmt: skip
    assert results["trained"].lossless and results["trained"].mismatches[0].tie


def test_the_untrained_reference_is_needed_only_where_the_output_differs_from_the_one_without_speculation():
    """With the untrained reference the untrained draft generates its first prompts (its acceptance) and, in one more
    pass, each prompt where the trained draft's output differs from the run without speculation: the verdict
    judges the trained draft there against that pass, names the prompt by its index in the evaluation, and refuses
    to judge a differing prompt the untrained draft did not generate."""
    from eagle3_workflow.evaluation.judge import draft_results, lossless_verdict, report_notes
    from eagle3_workflow.evaluation.measurements import UNTRAINED_DIVERGENT, Evaluation, Measured, differing_prompts
    from eagle3_workflow.evaluation.prompts import EvalPrompt, PromptSet

    plain = (
        [[1, 2], [1, 2, 8, 3], [4, 5]],
        [[{1: 9.0}, {2: 9.0}], [{1: 9.0}, {2: 9.0}, B, {3: 9.0}], [{4: 9.0}, {5: 9.0}]],
    )
    # the trained draft flipped prompt 1's near-tie (its own argmax: verification numerics, as on CPU)
    trained = (
        plain[0][:1] + [[1, 2, 7, 3]] + plain[0][2:],
        plain[1][:1] + [[{1: 9.0}, {2: 9.0}, A, {3: 9.0}]] + plain[1][2:],
    )
    prompt_set = PromptSet(prompts=[EvalPrompt(token_ids=[1], origin=f"row {i}") for i in range(3)], source="heldout",
                           requested=3, detail="test", notes=[])  # fmt: skip

    def judge(divergent: tuple[list[list[int]], list[list[dict[int, float]]]] | None):
        lossless = {"no_speculation": _lossless_run("no_speculation", *plain), "trained": _lossless_run("trained", *trained),
                    "untrained": _lossless_run("untrained", plain[0][:1], plain[1][:1]).model_copy(
                        update={"prompt_indices": [0]})}  # fmt: skip
        if divergent is not None:
            lossless[UNTRAINED_DIVERGENT] = _lossless_run("untrained", *divergent).model_copy(
                update={"label": UNTRAINED_DIVERGENT, "prompt_indices": [1]}
            )
        verdict = lossless_verdict(lossless, prompt_set, logit_dtype="bfloat16", tie_steps=0, numerics="production",
                                   decode=str, reference="untrained")  # fmt: skip
        measured = Measured(lossless=lossless, timing=dict(lossless), processes=[])
        return verdict, measured, draft_results(measured, verdict, {"trained": Path("t"), "untrained": Path("u")}, 3)

    assert differing_prompts({"no_speculation": _lossless_run("no_speculation", *plain),
                              "trained": _lossless_run("trained", *trained)}) == [1]  # fmt: skip
    with pytest.raises(StageError, match=r"the untrained draft's run lacks prompt\(s\) \[1\]"):
        judge(None)
    # the untrained draft's run of prompt 1 flipped the same near-tie: the same numerics, so the trained draft passes
    verdict, measured, results = judge(([trained[0][1]], [trained[1][1]]))
    assert results["trained"].lossless and verdict.judged() == {"trained": []}
    assert [m.prompt_index for m in results["trained"].no_speculation_divergences] == [1]
    untrained = results["untrained"]
    assert (untrained.acceptance_prompts, untrained.reference_prompts) == ([0], [1])
    assert untrained.mean_acceptance_length == pytest.approx(1.3)  # the first pass's counters
    assert [m.prompt_index for m in untrained.no_speculation_divergences] == [1]
    evaluation_ = Evaluation(evaluation(), VLLM_SETTINGS, "cpu", prompt_set, None, Path("w"))  # type: ignore[arg-type]
    note = next(n for n in report_notes(results, verdict, measured, evaluation_) if n.startswith("lossless reference"))
    assert "(1/3 prompts: [1])" in note and "first 1 prompt(s)" in note and "prompts [1] as the reference" in note
    # it emitted prompt 1's token 2 as the verifier ranked it (no flip): the two speculative runs differ there, and
    # the failure names prompt 1, not the pass's first prompt
    verdict, _, results = judge(([plain[0][1]], [plain[1][1]]))
    (found,) = results["trained"].mismatches
    assert (found.prompt_index, found.origin, found.position, found.expected_token, found.found_token) == (
        1, "row 1", 2, 8, 7)  # fmt: skip
    # a token that is not its own argmax in that pass is named by its prompt too
    wrong = ([[1, 9, 8, 3]], [[{1: 9.0}, {2: 9.0, 9: 8.5}, B, {3: 9.0}]])
    verdict, _, results = judge(wrong)
    assert verdict.non_argmax["untrained"] == [
        "prompt 1 token 1: emitted 9 (logit 8.5000), argmax 2 (logit 9.0000), 8.00 bfloat16 steps below it"
    ]
    assert not results["untrained"].lossless


def test_a_wrong_acceptance_fails_both_ways_with_its_margin():
    """accept_any_draft's signature: the speculative runs emit draft tokens the verifier ranked lower. The argmax
    check fails them with the margin (dtype steps below the argmax), and the two drafts' outputs differ."""
    trained = ([[1, 9, 7, 3], [4, 5]], [[{1: 9.0}, {2: 9.0, 9: 8.5}, A, {3: 9.0}], [{4: 9.0}, {5: 9.0}]])
    untrained = ([[1, 6, 7, 3], [4, 5]], [[{1: 9.0}, {2: 9.0, 6: 4.0}, A, {3: 9.0}], [{4: 9.0}, {5: 9.0}]])
    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": trained, "untrained": untrained},
                              reference="untrained")  # fmt: skip
    assert not results["trained"].lossless and not results["untrained"].lossless
    assert results["trained"].non_argmax_min_gap_steps == pytest.approx(0.5 / 2**-4)  # 0.5 at ~9: 8 steps
    assert results["untrained"].non_argmax_min_gap_steps == pytest.approx(5.0 / 2**-4)
    assert verdict.non_argmax["trained"] == [
        "prompt 0 token 1: emitted 9 (logit 8.5000), argmax 2 (logit 9.0000), 8.00 bfloat16 steps below it"
    ]
    assert [m.position for m in results["trained"].mismatches] == [1]
    # with no reference the argmax check alone fails them all the same
    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": trained, "untrained": untrained},
                              reference="none")  # fmt: skip
    assert not results["trained"].lossless and results["trained"].non_argmax_min_gap_steps == pytest.approx(8.0)
    message = lossless_failure(verdict.judged(), verdict.non_argmax, num_prompts=2, tie_steps=0,
                               numerics="production", reference="none")  # fmt: skip
    assert "judged by the argmax check alone): 0/2 prompts with the trained draft" in message
    assert "8.00 bfloat16 steps below it" in message


def test_the_reference_follows_the_device_and_refuses_a_tie_allowance_it_cannot_use():
    from eagle3_workflow.evaluation.plan import lossless_reference, plan_measurements

    assert lossless_reference("auto", "cpu", tie_steps=0) == "untrained"
    assert lossless_reference("auto", "cuda", tie_steps=3) == "no_speculation"
    assert lossless_reference("no_speculation", "cpu", tie_steps=1) == "no_speculation"
    with pytest.raises(StageError, match="lossless_tie_steps is 1, but the lossless reference is the untrained"):
        lossless_reference("auto", "cpu", tie_steps=1)
    assert lossless_reference("none", "cuda", tie_steps=0) == "none"
    with pytest.raises(StageError, match="lossless_tie_steps is 2"):
        lossless_reference("none", "cpu", tie_steps=2)
    plan = plan_measurements(_labelled(), settings=evaluation(), vllm_settings=VLLM_SETTINGS, device="cpu",
                             numerics="production", reference="untrained")  # fmt: skip
    assert [(r.label, r.lossless_alone, r.lossless_prompts) for r in plan[0].runs] == [
        ("no_speculation", False, None), ("trained", True, None), ("untrained", True, [0, 1, 2, 3])]  # fmt: skip
    plan = plan_measurements(_labelled(), settings=evaluation(), vllm_settings=VLLM_SETTINGS, device="cuda",
                             numerics="batch_invariant", reference="no_speculation")  # fmt: skip
    assert not any(r.lossless_alone or r.lossless_prompts is not None for p in plan for r in p.runs)


# ---------------------------------------------------------------- engine settings and the measurement process


def test_engine_kwargs_follow_the_vllm_config_and_device():
    cpu = measurement_engine_kwargs(VLLM_SETTINGS, target="/t", dtype="bfloat16", trust_remote_code=False, seed=0, device="cpu",
                        tensor_parallel_size=1, in_process=True)  # fmt: skip
    assert cpu["kv_cache_memory_bytes"] == VLLM_SETTINGS.kv_cache_memory_bytes
    assert cpu["enforce_eager"]
    assert cpu["distributed_executor_backend"] == "uni"
    assert cpu["disable_log_stats"] is False
    assert "gpu_memory_utilization" not in cpu
    gpu = measurement_engine_kwargs(VLLM_SETTINGS.model_copy(update={"kv_cache_memory_bytes": None}), target="/t", dtype="bfloat16",
                        trust_remote_code=True, seed=0, device="cuda", tensor_parallel_size=8, in_process=False)  # fmt: skip
    assert gpu["gpu_memory_utilization"] == 0.85
    assert gpu["tensor_parallel_size"] == 8
    assert gpu["trust_remote_code"]
    assert "distributed_executor_backend" not in gpu
    assert "kv_cache_memory_bytes" not in gpu
    run = eagle3_run("trained", Path("draft"), 3)
    assert run.speculative_config == {"method": "eagle3", "model": str(Path("draft").resolve()),
                                      "num_speculative_tokens": 3}  # fmt: skip


def test_measurement_environment(monkeypatch):
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    env = measurement_environment(device="cpu", cpu_threads=2, in_process=True)
    assert env["OMP_NUM_THREADS"] == "2"
    assert "TORCHDYNAMO_DISABLE" not in env
    assert (
        measurement_environment(device="cpu", cpu_threads=2, in_process=True, eager=True)["TORCHDYNAMO_DISABLE"] == "1"
    )
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert str(REPO / "workflow" / "scripts") in env["PYTHONPATH"].split(":")
    env = measurement_environment(device="cuda", cpu_threads=2, in_process=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env or env["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0"
    assert "TORCHDYNAMO_DISABLE" not in measurement_environment(
        device="cuda", cpu_threads=2, in_process=False, eager=True
    )


def test_the_spec_not_the_environment_chooses_the_kernels(monkeypatch):
    """The measurement process sets vLLM's batch-invariant switch from its spec before it imports vLLM; an inherited
    switch does not leak into a production process."""
    from eagle3_workflow.evaluation.measure import numerics, use_kernels

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert "VLLM_BATCH_INVARIANT" in measurement_environment(device="cuda", cpu_threads=None, in_process=False)
    use_kernels(batch_invariant=False)
    assert numerics() == "production"
    use_kernels(batch_invariant=True)
    assert numerics() == "batch_invariant"


@pytest.mark.parametrize(
    ("modules", "absent"),
    [
        (
            ["prompts", "metrics", "lossless", "protocol", "fingerprint", "resume", "parity_reference", "gate"],
            ["vllm", "torch", "subprocess"],
        ),
        # vLLM re-imports the stage as __main__
        (["stage", "plan", "measurements", "judge", "launch", "baseline", "measure"], ["vllm", "torch"]),
    ],
)
def test_evaluation_modules_import_no_engine_at_module_level(modules, absent):
    """A fresh interpreter imports the modules; the heavy ones load only inside the functions that run them."""
    imports = "; ".join(f"import eagle3_workflow.evaluation.{name}" for name in modules)
    code = f"import sys; {imports}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    env = measurement_environment(device="cpu", cpu_threads=None, in_process=True)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------- the untrained baseline


@pytest.fixture(scope="module")
def scratch_draft(prepared, tmp_path_factory):
    return build_scratch_draft(prepared["target"], prepared["token_freq"], tmp_path_factory.mktemp("draft") / "d")


def test_untrained_draft_has_the_trained_shape_vocab_and_frozen_tensors(scratch_draft, prepared, tmp_path):
    from safetensors.torch import load_file

    baseline = build_untrained_draft(scratch_draft, prepared["target"], tmp_path / "untrained", seed=1)
    assert baseline.frozen_tensors_differing == []
    trained, fresh = load_file(scratch_draft / "model.safetensors"), load_file(baseline.path / "model.safetensors")
    assert trained.keys() == fresh.keys()
    assert all(trained[k].shape == fresh[k].shape for k in trained)
    assert all(trained[k].dtype == fresh[k].dtype for k in trained)
    assert (trained["d2t"] == fresh["d2t"]).all()
    assert (trained["t2d"] == fresh["t2d"]).all()
    assert not (trained["fc.weight"] == fresh["fc.weight"]).all()  # fresh weights (another seed)
    config = json.loads((baseline.path / "config.json").read_text())  # speculators' file, checked key by key
    assert config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(Path(prepared["target"]).resolve())


def untrained_key(untrained_dir: Path, target: Path, work_dir: Path) -> str:
    """The key of the untrained engine's result (what decides whether a resumed stage reuses it)."""
    from eagle3_workflow.evaluation.resume import keyed_run

    run = eagle3_run("untrained", untrained_dir, 3)
    return keyed_run(run, {"model": str(target)}, {"prompts": [[1, 2]], "max_tokens": 8}, batch_invariant=False,
                     work_dir=work_dir).key  # fmt: skip


@pytest.fixture
def size_mtime_fingerprints(monkeypatch):
    """Every file fingerprinted by size:mtime, as an 8B target's weights and its 1.77 GiB untrained draft are."""
    import eagle3_workflow.evaluation.fingerprint as fingerprint

    monkeypatch.setattr(fingerprint, "CONTENT_HASH_LIMIT", 0)


@pytest.mark.usefixtures("size_mtime_fingerprints")
def test_a_resumed_stage_keeps_the_untrained_draft_and_so_its_engines_keys(scratch_draft, prepared, tmp_path):
    """At the 8B shape the untrained draft's model.safetensors (1.77 GiB) is above CONTENT_HASH_LIMIT, so its
    fingerprint is size:mtime: rebuilt on every attempt, its new mtime changed the key of both untrained engines
    and each resume measured them again (86 s + 36 s of engine starts on an H100, 2026-12-06). The limit at 0 puts
    the tiny draft on that path: a second build from the same recipe keeps the files and the key."""
    import eagle3_workflow.evaluation.fingerprint as fingerprint

    out = tmp_path / "untrained"
    first = build_untrained_draft(scratch_draft, prepared["target"], out, seed=1)
    key = untrained_key(out, prepared["target"], tmp_path / "work")
    written = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert all(":" in v for v in fingerprint.model_fingerprint(out).values())  # size:mtime, not content

    again = build_untrained_draft(scratch_draft, prepared["target"], out, seed=1)
    assert untrained_key(out, prepared["target"], tmp_path / "work") == key
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == written  # not one file written again
    assert (first.kept, again.kept) == (False, True)
    assert (again.path, again.description, again.frozen_tensors_differing) == (
        first.path, first.description, first.frozen_tensors_differing)  # fmt: skip


@pytest.mark.usefixtures("size_mtime_fingerprints")
@pytest.mark.parametrize("change", ["retrained draft", "another target", "seed", "build cut short", "files touched"])
def test_the_untrained_draft_is_built_again_when_what_decides_its_bytes_changed(change, scratch_draft, prepared,
                                                                               tmp_path, caplog):  # fmt: skip
    """A kept baseline must still be the one its inputs make: a retrained draft (its d2t/t2d, config, dtype),
    another verifier (embed_tokens, lm_head, its path in the config) or seed rebuild it, and so does a folder whose
    build was cut before recipe.json (written last) or whose files changed since (size:mtime, as at the 8B shape)."""
    import shutil

    from safetensors.torch import load_file

    draft = Path(shutil.copytree(scratch_draft, tmp_path / "draft"))
    target, seed, out = Path(prepared["target"]), 1, tmp_path / "untrained"
    build_untrained_draft(draft, target, out, seed)
    key = untrained_key(out, target, tmp_path / "work")
    if change == "retrained draft":
        shift_d2t(draft / "model.safetensors")
    elif change == "another target":
        target = Path(shutil.copytree(target, tmp_path / "target"))
    elif change == "seed":
        seed = 2
    elif change == "build cut short":
        (out / "recipe.json").unlink()
    else:
        (out / "config.json").write_text((out / "config.json").read_text())  # same bytes, a new mtime
    with caplog.at_level("INFO", logger="eagle3.evaluation"):
        rebuilt = build_untrained_draft(draft, target, out, seed)
    assert not rebuilt.kept
    assert "building it again" in caplog.text
    assert untrained_key(out, target, tmp_path / "work") != key
    fresh = load_file(out / "model.safetensors")
    assert (fresh["d2t"] == load_file(draft / "model.safetensors")["d2t"]).all()  # the mapping it has now
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == str(
        target.resolve())  # fmt: skip
    assert build_untrained_draft(draft, target, out, seed).kept  # and that build is kept in turn


# ---------------------------------------------------------------- the plan: which engines, which kernels, reuse


def _labelled():
    from eagle3_workflow.evaluation.protocol import MeasurementRun

    return [MeasurementRun(label="no_speculation", speculative_config=None), eagle3_run("trained", Path("d"), 3),
            eagle3_run("untrained", Path("u"), 3)]  # fmt: skip


def test_cpu_runs_the_lossless_and_timing_passes_on_one_engine_per_label_in_one_process():
    from eagle3_workflow.evaluation.plan import lossless_numerics, plan_measurements

    settings = evaluation()
    assert lossless_numerics("auto", "cpu") == "production"
    plan = plan_measurements(_labelled(), settings=settings, vllm_settings=VLLM_SETTINGS, device="cpu",
                             numerics="production")  # fmt: skip
    assert len(plan) == 1
    assert not plan[0].batch_invariant
    assert [(r.label, r.lossless_pass, r.timing_pass) for r in plan[0].runs] == [
        ("no_speculation", True, True), ("trained", True, True), ("untrained", True, True)]  # fmt: skip
    assert all(r.engine_overrides == {"logprobs_mode": "raw_logits"} for r in plan[0].runs)  # no CUDA graphs on CPU
    with pytest.raises(StageError, match="batch-invariant kernels exist for CUDA only"):
        lossless_numerics("batch_invariant", "cpu")


def test_cuda_times_with_cuda_graphs_and_checks_losslessness_in_batch_invariant_processes():
    from eagle3_workflow.evaluation.plan import all_eager, lossless_numerics, plan_measurements

    settings = evaluation(timing_concurrency=[1, 8])
    vllm_settings = VLLM_SETTINGS.model_copy(update={"enforce_eager": True, "generation_cuda_graphs": True})
    assert lossless_numerics("auto", "cuda") == "batch_invariant"
    # one engine per process on a GPU (a spec-decode engine's KV cache outlived vLLM's cleanup on the H200)
    plan = plan_measurements(_labelled(), settings=settings, vllm_settings=vllm_settings, device="cuda",
                             numerics="batch_invariant")  # fmt: skip
    assert [len(p.runs) for p in plan] == [1] * 6
    assert [p.batch_invariant for p in plan] == [False] * 3 + [True] * 3
    timing = [p.runs[0] for p in plan[:3]]
    exact = [p.runs[0] for p in plan[3:]]
    assert all(r.timing_pass and not r.lossless_pass for r in timing)
    assert all(r.engine_overrides == {"enforce_eager": False, "max_num_seqs": 8} for r in timing)
    assert all(r.lossless_pass and not r.timing_pass for r in exact)
    assert all(r.engine_overrides == {"logprobs_mode": "raw_logits", "enforce_eager": True} for r in exact)
    shared = plan_measurements(_labelled(), settings=evaluation(isolate_runs=False), vllm_settings=vllm_settings,
                               device="cuda", numerics="batch_invariant")  # fmt: skip
    assert [(len(p.runs), p.batch_invariant) for p in shared] == [(3, False), (3, True)]
    # eager engines only (no torch.compile wanted in their process: runtime.child_environment) for the lossless ones
    assert not all_eager({"enforce_eager": True}, [p.runs[0] for p in plan])
    assert all_eager({"enforce_eager": True}, exact)
    # eager also where the config serves with CUDA graphs: they measure outputs, and each paid a compilation
    # (8B shape, H100: 113.6 s for the no-speculation lossless engine's start)
    assert all_eager({"enforce_eager": False}, exact)
    served = VLLM_SETTINGS.model_copy(update={"enforce_eager": False})
    graphs = plan_measurements(_labelled(), settings=settings, vllm_settings=served, device="cuda",
                               numerics="batch_invariant")  # fmt: skip
    assert [all_eager({"enforce_eager": False}, p.runs) for p in graphs] == [False] * 3 + [True] * 3


def test_without_time_untrained_the_baseline_loses_only_its_timing_pass():
    from eagle3_workflow.evaluation.metrics import acceptance_result, summary_table
    from eagle3_workflow.evaluation.plan import plan_measurements
    from eagle3_workflow.evaluation.protocol import ConcurrencyTiming, RunResult

    settings = evaluation(time_untrained=False, timing_concurrency=[1, 8])
    cpu = plan_measurements(_labelled(), settings=settings, vllm_settings=VLLM_SETTINGS, device="cpu",
                            numerics="production")  # fmt: skip
    assert [(r.label, r.lossless_pass, r.timing_pass) for r in cpu[0].runs] == [
        ("no_speculation", True, True), ("trained", True, True), ("untrained", True, False)]  # fmt: skip
    cuda = plan_measurements(_labelled(), settings=settings, vllm_settings=VLLM_SETTINGS, device="cuda",
                             numerics="batch_invariant")  # fmt: skip
    assert [(p.runs[0].label, p.batch_invariant) for p in cuda] == [
        ("no_speculation", False), ("trained", False),  # no timing engine for the untrained draft
        ("no_speculation", True), ("trained", True), ("untrained", True)]  # every lossless engine kept  # fmt: skip
    default = plan_measurements(_labelled(), settings=evaluation(), vllm_settings=VLLM_SETTINGS, device="cuda",
                                numerics="batch_invariant")  # fmt: skip
    assert len(default) == 6

    def run(label, timings, metrics):
        return RunResult(label=label, engine_start_s=3.0, generate_s=1.0, generated_tokens=40, outputs=[],
                         finish_reasons=[], top_logits=[], metrics_before=[], metrics_after=metrics, load_1m=0.0,
                         timings=timings)  # fmt: skip

    counters = [counter("num_drafts", 10), counter("num_draft_tokens", 30), counter("num_accepted_tokens", 3),
                per_position([2, 1, 0])]  # fmt: skip
    reference = run("no_speculation", [ConcurrencyTiming(concurrency=1, prompts=4, generated_tokens=400, seconds=2.0,
                                                         seconds_passes=[2.0])], [])  # fmt: skip
    untrained = acceptance_result(run("untrained", [], counters), None, draft_path=Path("u"),
                                  num_speculative_tokens=3, reference_timing=reference, mismatches=[],
                                  non_argmax=[])  # fmt: skip
    assert untrained.mean_acceptance_length == pytest.approx(1.3)  # acceptance measured as before
    assert untrained.per_position_acceptance == pytest.approx([0.2, 0.1, 0.0])
    assert (untrained.throughput, untrained.tokens_per_s, untrained.speedup) == ([], 0.0, 0.0)
    assert untrained.engine_start_s == 3.0 and untrained.lossless
    from synthetic_run import acceptance_report

    table = summary_table(acceptance_report().model_copy(update={"untrained": untrained}))
    row = next(line for line in table.splitlines() if line.startswith("untrained"))
    assert "not timed" in row and "0.00" not in row.split("|")[4:6]


def test_a_measured_engine_is_reused_only_while_its_key_holds(tmp_path):
    from eagle3_workflow.evaluation.protocol import RunResult
    from eagle3_workflow.evaluation.resume import keyed_run, reusable_result
    from eagle3_workflow.files.artefacts import write

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"weights v1")
    run = eagle3_run("trained", draft, 3)
    fields = {"prompts": [[1, 2]], "max_tokens": 8}
    keyed = keyed_run(run, {"model": str(tmp_path)}, fields, batch_invariant=True, work_dir=tmp_path / "work")
    assert keyed.result_path == str(tmp_path / "work" / "runs" / "trained.both.json")
    assert reusable_result(keyed) is None  # nothing measured yet
    result = RunResult(label="trained", key=keyed.key, engine_start_s=1.0, generate_s=1.0, generated_tokens=2,
                       outputs=[[3, 4]], finish_reasons=["stop"], top_logits=[[{3: 1.0}, {4: 1.0}]],
                       metrics_before=[], metrics_after=[], load_1m=0.0)  # fmt: skip
    write(keyed.result_path, result)
    assert reusable_result(keyed) == result
    same = keyed_run(run, {"model": str(tmp_path)}, fields, batch_invariant=True, work_dir=tmp_path / "work")
    assert same.key == keyed.key
    (draft / "model.safetensors").write_bytes(b"weights v2")  # retrained: same path, other bytes
    retrained = keyed_run(run, {"model": str(tmp_path)}, fields, batch_invariant=True, work_dir=tmp_path / "work")
    assert retrained.key != keyed.key
    assert reusable_result(retrained) is None
    other_kernels = keyed_run(run, {"model": str(tmp_path)}, fields, batch_invariant=False, work_dir=tmp_path / "w")
    assert other_kernels.key != retrained.key


def test_an_engine_reused_from_an_earlier_attempt_is_named_in_the_report(tmp_path):
    """A resumed evaluation (the real-width Kimi run, cut in its third engine) measures only what is left; the
    report says which engines an earlier attempt measured, since `processes` lists only this attempt's."""
    from eagle3_workflow.evaluation.judge import report_notes
    from eagle3_workflow.evaluation.measurements import Evaluation, Measured, runs_to_measure
    from eagle3_workflow.evaluation.plan import PlannedProcess
    from eagle3_workflow.evaluation.prompts import EvalPrompt, PromptSet
    from eagle3_workflow.evaluation.protocol import MeasurementRun
    from eagle3_workflow.evaluation.resume import keyed_run
    from eagle3_workflow.files.artefacts import write

    engine, fields, work = {"model": str(tmp_path)}, {"prompts": [[1, 2]], "max_tokens": 8}, tmp_path / "work"
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"weights")
    plain, trained = MeasurementRun(label="no_speculation", speculative_config=None), eagle3_run("trained", draft, 3)
    earlier = keyed_run(plain, engine, fields, batch_invariant=True, work_dir=work)
    write(earlier.result_path, _lossless_run("no_speculation", [[1, 2]], [[{1: 9.0}, {2: 9.0}]]).model_copy(
        update={"key": earlier.key}))  # fmt: skip
    measured = Measured(lossless={}, timing={}, processes=[])
    plan = [PlannedProcess(runs=[plain], batch_invariant=True), PlannedProcess(runs=[trained], batch_invariant=True)]
    pending = runs_to_measure(plan, engine, fields, measured, work_dir=work, first_index=0)
    assert [(i, [r.label for r in runs]) for i, _, runs in pending] == [(1, ["trained"])]
    assert measured.reused == ["no_speculation.both"] and "no_speculation" in measured.lossless

    verdict, results = _judge({"no_speculation": NO_SPECULATION, "trained": SPECULATIVE, "untrained": SPECULATIVE},
                              reference="untrained")  # fmt: skip
    prompt_set = PromptSet(prompts=[EvalPrompt(token_ids=[1], origin=f"row {i}") for i in range(2)], source="heldout",
                           requested=2, detail="test", notes=[])  # fmt: skip
    evaluation_ = Evaluation(evaluation(), VLLM_SETTINGS, "cpu", prompt_set, None, Path("w"))  # type: ignore[arg-type]
    lossless = {label: _lossless_run(label, *run) for label, run in
                {"no_speculation": NO_SPECULATION, "trained": SPECULATIVE, "untrained": SPECULATIVE}.items()}  # fmt: skip
    resumed = Measured(lossless=lossless, timing=dict(lossless), processes=[], reused=measured.reused)
    notes = report_notes(results, verdict, resumed, evaluation_)
    assert any("earlier attempt" in n and "no_speculation.both" in n for n in notes)
    fresh = Measured(lossless=lossless, timing=dict(lossless), processes=[])
    assert not any("earlier attempt" in n for n in report_notes(results, verdict, fresh, evaluation_))


def test_throughput_rows_give_the_speedup_at_each_concurrency_and_the_step_time_at_one():
    from eagle3_workflow.evaluation.metrics import throughput
    from eagle3_workflow.evaluation.protocol import ConcurrencyTiming, RunResult

    def run(label, timings):
        return RunResult(label=label, engine_start_s=1.0, generate_s=0.0, generated_tokens=0, outputs=[],
                         finish_reasons=[], top_logits=[], metrics_before=[], metrics_after=[], load_1m=0.0,
                         timings=timings)  # fmt: skip

    plain = run("no_speculation", [ConcurrencyTiming(concurrency=1, prompts=4, generated_tokens=400, seconds=2.0,
                                                     seconds_passes=[2.0, 2.5]),
                                   ConcurrencyTiming(concurrency=8, prompts=4, generated_tokens=400, seconds=0.5,
                                                     seconds_passes=[0.5])])  # fmt: skip
    spec = run("trained", [ConcurrencyTiming(concurrency=1, prompts=4, generated_tokens=400, seconds=1.0,
                                             seconds_passes=[1.0], verify_steps=160),
                           ConcurrencyTiming(concurrency=8, prompts=4, generated_tokens=400, seconds=0.4,
                                             seconds_passes=[0.4], verify_steps=160)])  # fmt: skip
    rows = throughput(spec, plain)
    assert [(r.concurrency, r.tokens_per_s, r.speedup) for r in rows] == [(1, 400.0, 2.0), (8, 1000.0, 1.25)]
    assert rows[0].ms_per_step == pytest.approx(6.25)  # 1 s over 160 verification steps
    assert rows[1].ms_per_step is None
    assert throughput(plain, None)[0].ms_per_step == pytest.approx(5.0)  # one token per step
    assert throughput(plain, None)[0].speedup is None
