"""The draft parity check's pure parts (evaluation/parity.py): the judge of served steps against the reference's
prediction (proposals and accepted counts), the near-tie rule, the served files against the trainer's checkpoint,
where the reference comes from, the failure message, the stage's wiring. The check for real, with vLLM serving the
tiny pipeline's trained draft and four injected faults: tests/e2e/test_served_draft_parity.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import evaluation
from safetensors.torch import save_file

from eagle3_workflow.evaluation.parity import (
    CAUSES,
    Served,
    config_differences,
    judge_parity,
    parity_failure,
    roundings,
    tie_bound,
)
from eagle3_workflow.evaluation.parity_reference import Predicted, TrainedDraft, trained_draft
from eagle3_workflow.evaluation.protocol import MeasurementRun
from eagle3_workflow.files.draft_artefacts import DraftParity

# prompt [0, 1], served output [2, 3, 4, 5, 2]: the trajectory, and a draft of k = 2 that proposes it exactly
PROMPT, OUTPUT, K, V, H = [0, 1], [2, 3, 4, 5, 2], 2, 6, 4
TRAJECTORY = PROMPT + OUTPUT


def reference(moved: dict[tuple[int, int], tuple[int, float]] | None = None) -> Predicted:
    """The reference's logits: at position j (the context ends at trajectory[j + 1]), proposal t is
    trajectory[j + 2 + t] at logit 10, every other token at 0; `moved` {(t, j): (token, logit)} sets another."""
    torch.manual_seed(0)
    logits = []
    for t in range(K):
        z = torch.zeros(len(TRAJECTORY) - 1, V)
        for j in range(len(TRAJECTORY) - 1):
            if j + 2 + t < len(TRAJECTORY):
                z[j, TRAJECTORY[j + 2 + t]] = 10.0
        for (tt, j), (token, logit) in (moved or {}).items():
            if tt == t:
                z[j, token] = logit
        logits.append(z)
    proposals = [[int(i) for i in z.argmax(-1)] for z in logits]
    return Predicted(logits=logits, proposals=proposals, inputs=[torch.randn(len(TRAJECTORY) - 1, H) for _ in range(K)],
                     head=torch.randn(V, H), num_draft_layers=1)  # fmt: skip


# the served run that follows it: the prefill's token, then 2 accepted + bonus, then the last token
STEPS = [1, 3, 1]
PROPOSALS = [[3, 4], [2, 0], []]


def judge(predicted, steps=STEPS, proposals=PROPOSALS):
    served = [Served(prompt=PROMPT, output=OUTPUT, steps=steps, proposals=proposals)]
    return judge_parity(served, [predicted], prompt_indices=[7], to_draft={i: i for i in range(V)}, layer_ids=[1],
                        dtype="bfloat16", decode=lambda ids: "".join(f"<{i}>" for i in ids))  # fmt: skip


def test_a_served_run_that_proposes_what_the_reference_predicts_agrees_at_every_step():
    tally = judge(reference())
    assert (tally.compared, tally.agreeing, tally.ties, tally.differences) == (2, 2, 0, [])
    assert tally.proposals == 3  # step 1: both proposals; step 2: the one within the output


def test_a_served_proposal_other_than_the_reference_fails_naming_both():
    # vLLM proposed 5 where the reference proposes 3 (rejected), then what the reference proposes
    tally = judge(reference(), steps=[1, 1, 3], proposals=[[5, 4], [4, 5], []])
    assert len(tally.differences) == 1 and tally.agreeing == 1
    first = tally.differences[0]
    assert (first.prompt_index, first.step, first.generated_position, first.proposal) == (7, 1, 1, 1)
    assert first.predicted_token == 3 and first.predicted_text == "<3>"
    assert first.served == "'<5>' (5)"
    assert first.gap_steps == pytest.approx(10.0 / 2.0**-4)  # 10 at the magnitude of 10: steps of 1/16
    assert first.gap_steps > 10 * first.tie_bound_steps


def test_a_near_tie_of_the_reference_is_excused_and_a_clear_win_is_not():
    # at position 1 the reference's second choice for proposal 1 is 5, 0.01 below its top (a tie), then 9 below
    tie = judge(reference({(0, 1): (5, 9.99)}), steps=[1, 1, 3], proposals=[[5, 4], [4, 5], []])
    assert tie.ties == 1 and tie.differences == []
    clear = judge(reference({(0, 1): (5, 1.0)}), steps=[1, 1, 3], proposals=[[5, 4], [4, 5], []])
    assert clear.ties == 0 and len(clear.differences) == 1


def test_without_the_proposals_the_accepted_counts_are_compared():
    # vLLM accepted nothing where the reference accepts 2: the reference's proposal 1 is named, vLLM's is unknown
    tally = judge(reference(), steps=[1, 1, 3], proposals=None)
    assert len(tally.differences) == 1  # the next step starts where the served one did: it agrees
    first = tally.differences[0]
    assert first.served.startswith("not '<3>'") and first.predicted_accepted == 2 and first.served_accepted == 0
    # vLLM accepted more than the reference: the token it proposed is the trajectory's
    weaker = reference({(0, 1): (5, 20.0)})
    tally = judge(weaker, proposals=None)
    assert tally.differences[0].served == "'<3>' (3, accepted)"
    assert tally.differences[0].predicted_token == 5


def test_a_truncated_last_step_agrees():
    # the output ends inside a block the reference would accept: the last step emits only what is left
    tally = judge(reference(), steps=[1, 3, 1], proposals=None)
    assert tally.agreeing == 2 and not tally.differences


def test_the_tie_bound_is_the_rounding_model():
    head, h = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([3.0, 4.0])
    u = 2.0**-8
    spread = math.hypot(3.0, -4.0)  # |(W[0] - W[1]) * h|
    expected = 4 * u / math.sqrt(3) * math.sqrt(25) * spread + 2.0**-4
    assert tie_bound(head, h, 0, 1, rounds=25, dtype="bfloat16", winner_logit=10.0) == pytest.approx(expected)
    # float32's unit is 2^16 times finer: the same roundings move the gap 2^16 times less
    fp32 = tie_bound(head, h, 0, 1, rounds=25, dtype="float32", winner_logit=10.0)
    assert fp32 == pytest.approx(expected / 2**16, rel=1e-3)
    # the target's layers up to the deepest aux layer, then one draft pass per proposal
    assert roundings([2, 4, 5], 0, 1) == 2 * 6 + 13
    assert roundings([2, 4, 5], 2, 1) == 2 * 6 + 3 * 13
    assert roundings([2, 4, 5], 0, 2) == 2 * 6 + 25  # each further draft layer: 12 more


def _checkpoint(folder: Path, *, norm_before_residual=True, theta=10000.0, shift=0) -> Path:
    folder.mkdir(parents=True)
    config = {"norm_before_residual": norm_before_residual, "draft_vocab_size": 4,
              "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
              "transformer_layer_config": {"max_position_embeddings": 4096,
                                           "rope_parameters": {"rope_theta": theta, "rope_type": "default"}}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file(
        {"d2t": torch.tensor([0, 1, 1, 2]) + shift, "fc.weight": torch.ones(2, 2)}, str(folder / "model.safetensors")
    )
    return folder


def test_the_served_files_are_compared_with_the_trainers_checkpoint(tmp_path):
    trained = TrainedDraft(_checkpoint(tmp_path / "ckpt"), [2, 4, 5], True, "the checkpoint")
    assert config_differences(_checkpoint(tmp_path / "same"), trained) == []
    found = config_differences(_checkpoint(tmp_path / "bad", norm_before_residual=False, theta=1e6, shift=1), trained)
    assert "norm_before_residual: served False, trained True" in found
    assert any(f.startswith("transformer_layer_config.rope_parameters: served") for f in found)
    assert "vocabulary mapping d2t: the served model.safetensors differs from the trainer's checkpoint" in found
    assert not any("fc.weight" in f for f in found)
    # layer ids other than training.json's, named once
    trained_on = TrainedDraft(trained.checkpoint, [1, 3, 4], True, "")
    assert config_differences(tmp_path / "same", trained_on) == [
        "eagle_aux_hidden_state_layer_ids: served [2, 4, 5], trained on [1, 3, 4]"
    ]
    # a reference read from the served folder itself has nothing to compare with
    assert config_differences(tmp_path / "bad", TrainedDraft(tmp_path / "bad", [2, 4, 5], False, "")) == []


def test_the_reference_is_the_checkpoint_training_json_names(tmp_path, monkeypatch):
    from synthetic_run import training_summary

    from eagle3_workflow.files.artefacts import write

    run = tmp_path / "results" / "r"
    checkpoint = _checkpoint(run / "train_work" / "checkpoints" / "2")
    draft = _checkpoint(run / "draft")
    summary = training_summary(draft)
    final = summary.final_checkpoint.model_copy(update={"path": "results/r/train_work/checkpoints/2"})
    write(
        draft / "training.json", summary.model_copy(update={"final_checkpoint": final, "target_layer_ids": [1, 3, 4]})
    )
    monkeypatch.chdir(tmp_path)  # the stage runs in the workflow's working directory
    found = trained_draft(draft)
    assert found.independent and found.checkpoint == checkpoint.resolve() and found.layer_ids == [1, 3, 4]
    # the same from another working directory: the run folder's own layout
    monkeypatch.chdir(run)
    assert trained_draft(draft).checkpoint == checkpoint.resolve()
    # the checkpoint gone (train_work cleaned): the served folder, said so
    import shutil

    shutil.rmtree(checkpoint)
    fallback = trained_draft(draft)
    assert not fallback.independent and fallback.checkpoint == draft.resolve() and fallback.layer_ids == [1, 3, 4]
    assert "is not seen" in fallback.source


def test_the_failure_names_the_step_the_proposals_the_files_and_every_cause():
    tally = judge(reference(), steps=[1, 1, 3], proposals=[[5, 4], [4, 5], []])
    parity = DraftParity(verdict="failed", prompts=[7], steps_compared=tally.compared, agreeing_steps=tally.agreeing,
                         ties_excused=tally.ties, differing_steps=len(tally.differences), dtype="bfloat16",
                         roundings=[15, 28], tie_sigmas=4.0, reference="the trainer's final checkpoint c",
                         independent=True, first_difference=tally.differences[0],
                         config_differences=["norm_before_residual: served False, trained True"])  # fmt: skip
    message = parity_failure(parity, draft="results/r/draft")
    assert message.startswith("draft parity FAILED for results/r/draft: vLLM's served draft does not propose")
    assert (
        "first difference: prompt 7, step 1 (generated token 1), proposal 1: predicted '<3>' (3), served '<5>' (5)"
        in message
    )
    assert "norm_before_residual: served False, trained True" in message
    for cause in CAUSES:
        assert cause in message
    assert "evaluate.draft_parity_prompts: 0" in message


def test_the_stage_serves_the_parity_pass_on_the_trained_draft_only():
    from eagle3_workflow.evaluation.protocol import eagle3_run

    settings = evaluation()
    assert settings.draft_parity_prompts == 4  # on by default, CPU and GPU alike
    run = eagle3_run("trained", Path("/d"), 3).model_copy(update={"parity_prompts": settings.draft_parity_prompts})
    assert MeasurementRun.model_validate_json(run.model_dump_json()).parity_prompts == 4
    source = (Path(__file__).parents[2] / "workflow/scripts/eagle3_workflow/evaluation/stage.py").read_text()
    assert (
        'eagle3_run("trained", draft, k).model_copy(update={"parity_prompts": settings.draft_parity_prompts})' in source
    )
    assert "raise StageError(parity_failure(parity, draft=str(draft)))" in source


def test_the_reference_predicts_each_step_from_the_context_before_it(prepared, tmp_path):
    """speculators' forward on a scratch draft of the tiny target, as the check runs it: proposal t from the step
    whose context ends at token m reads no token past m + t (the trajectory's tokens stand for the accepted
    proposals only up to there), so a trajectory cut after that predicts the same logits."""
    from synthetic_run import build_scratch_draft

    from eagle3_workflow.evaluation.parity_reference import aux_states, load_reference_draft, predict, target_ids

    draft = build_scratch_draft(prepared["target"], prepared["token_freq"], tmp_path / "d")
    layer_ids = json.loads((draft / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    model = load_reference_draft(TrainedDraft(draft, layer_ids, False, ""), prepared["target"])
    trajectory = [1, 15, 27, 33, 48, 52, 61, 70, 88, 95, 101, 7, 9, 12]
    full_aux, cut_aux = aux_states(
        prepared["target"], [trajectory, trajectory[:9]], layer_ids, trust_remote_code=False, device="cpu"
    )
    full = predict(model, full_aux, trajectory, 3)
    cut = predict(model, cut_aux, trajectory[:9], 3)
    assert [len(z) for z in full.logits] == [len(trajectory) - 1] * 3 and full.num_draft_layers == 1
    to_target = target_ids(model)
    assert full.proposals[0] == [to_target[int(i)] for i in full.logits[0].argmax(-1)]
    m = 5  # the context ends at trajectory[5]: proposal t reads trajectory[..m + t]
    for t in range(3):
        assert torch.allclose(full.logits[t][m - 1], cut.logits[t][m - 1], atol=1e-5), t
