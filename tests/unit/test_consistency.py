"""The train/serve consistency gate (evaluation/consistency.py): its derivation checked against speculators' own
accuracy code, the rule on each fault's shape, the committed real runs under it, the stage's wiring, and absolute
paths in every measurement spec. The gate for real through Snakemake (a shifted d2t): tests/integration/
test_evaluation_engine.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import REPO, evaluation, tiny_settings
from synthetic_run import acceptance_report, training_summary

from eagle3_workflow.evaluation.consistency import (
    consistency_failure,
    consistency_table,
    judge_consistency,
)
from eagle3_workflow.evaluation.judge import train_serve_consistency
from eagle3_workflow.evaluation.launch import measurement_engine_kwargs
from eagle3_workflow.evaluation.protocol import MeasurementRun, MeasurementSpec, eagle3_run
from eagle3_workflow.evaluation.resume import keyed_run
from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, TrainingSummary
from eagle3_workflow.settings.stages import ServingStage

DEFAULTS = evaluation()
RULE = dict(min_ratio=DEFAULTS.consistency_min_ratio, min_predicted=DEFAULTS.consistency_min_predicted)
# the committed H200 runs: the one-lease overlay (1.12 at k = 3) and the shipped preset with Python-steered data
# (2.55 at k = 3, served/predicted 0.91/0.82/0.72)
GPU_RUNS = [REPO / "bench/gpu/results" / name for name in
            ("2026-12-02-smollm2-135m-gpu-one-lease", "2026-12-03-smollm2-135m-gpu-python")]  # fmt: skip


def judge(predicted, served, num_drafts=500, **rule):
    return judge_consistency(predicted, served, num_drafts=num_drafts, **(RULE | rule))


# ---------------------------------------------------------------- the derivation


def test_full_acc_is_the_served_acceptance_at_each_position_and_cond_acc_is_not():
    """speculators' full_acc_k counts positions whose steps 0..k were all right: what greedy verification accepts
    at draft position k (accepted at k / drafts). cond_acc_k divides by the positions right through k-1."""
    import torch

    # speculators' own file, loaded alone (it imports only torch; the package's __init__ imports transformers)
    package = Path(importlib.util.find_spec("speculators").origin).parent
    loaded = importlib.util.spec_from_file_location("speculators_metrics", package / "models" / "metrics.py")
    metrics = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(metrics)
    compute_accuracy_single_step = metrics.compute_accuracy_single_step

    # 8 positions x 3 TTT steps: True = the draft's argmax equals the target's there
    right = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]],
                         dtype=torch.bool)  # fmt: skip
    prev = torch.ones(1, 8, dtype=torch.bool)
    full, cond = [], []
    for k in range(3):
        pred = torch.where(right[:, k], 5, 6).unsqueeze(0)
        sums = compute_accuracy_single_step(pred, torch.full((1, 8), 5), None, prev)
        full.append(float(sums[0] / sums[1]))
        cond.append(float(sums[2] / sums[3]))
    # greedy verification: position k is accepted iff positions 0..k all match
    accepted = [sum(all(row[: k + 1]) for row in right.tolist()) / 8 for k in range(3)]
    assert full == pytest.approx(accepted)  # 6/8, 4/8, 2/8
    assert cond == pytest.approx([6 / 8, 4 / 6, 2 / 4])
    assert cond != pytest.approx(accepted)


# ---------------------------------------------------------------- the rule on each fault's shape

# served numbers of each fault's shape (synthetic, not measured; the shifted d2t is also run for real): the served
# draft is not the validated model or gets other inputs, and acceptance collapses at every position
FAULTS = {
    # each draft id names its neighbour's target token: a correct draft token is never the right target id
    "d2t shifted by one id": ([0.785, 0.637, 0.535], [0.004, 0.0, 0.0]),
    # the server hands the draft other layers' hidden states than it was trained on
    "layer-id offset": ([0.785, 0.637, 0.535], [0.09, 0.02, 0.004]),
    # rotary positions past the cut are wrong (or the draft is refused there): long prompts stop accepting
    "cut max_position_embeddings": ([0.734, 0.564, 0.454], [0.15, 0.06, 0.02]),
    # prompts rendered with another template: the draft sees contexts unlike its training data
    "another chat template": ([0.672, 0.575, 0.518], [0.11, 0.05, 0.03]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_fails_the_rule_and_the_message_names_the_causes(fault):
    predicted, served = FAULTS[fault]
    result = judge(predicted, served)
    assert result.verdict == "failed", result
    message = consistency_failure(result, draft="results/r/draft")
    assert "train/serve consistency FAILED for results/r/draft" in message
    for needle in ("d2t/t2d", "max_position_embeddings", "layer-id offset", "chat template"):
        assert needle in message
    assert f"{served[0]:.3f}" in message and f"{predicted[0]:.3f}" in message  # the table
    assert "evaluate.consistency_min_ratio" in message  # the escape hatch, named


def test_a_weak_draft_that_validated_as_weak_passes():
    # the committed one-lease H200 draft: 1.12 mean acceptance, validation as weak
    result = judge([0.158, 0.020, 0.005], [0.111, 0.007, 0.002])
    assert result.verdict == "passed"
    assert result.ratio[0] == pytest.approx(0.111 / 0.158)


def test_the_bar_is_a_ratio_of_the_prediction():
    assert judge([0.8], [0.21]).verdict == "passed"  # 0.25 x 0.8 = 0.2
    assert judge([0.8], [0.19]).verdict == "failed"
    assert judge([0.8], [0.19], min_ratio=0.2).verdict == "passed"  # 0.16
    assert judge([0.4], [0.09]).verdict == "failed"  # 0.1: the bar moves with the prediction


@pytest.mark.parametrize(
    "predicted, num_drafts, rule, reason",
    [
        (None, 500, {}, "no validation accuracy"),
        ([], 500, {}, "no validation accuracy"),
        ([0.04, 0.01], 500, {}, "too weak a draft"),
        ([0.8, 0.6], 10, {}, "the served rate is noise"),
        ([0.8, 0.6], 500, {"min_ratio": 0}, "(off)"),
    ],
)
def test_what_is_not_judged_is_recorded_not_failed(predicted, num_drafts, rule, reason):
    result = judge(predicted, [0.0, 0.0, 0.0], num_drafts=num_drafts, **rule)
    assert result.verdict == "not judged"
    assert reason in result.reason
    consistency_table(result)  # renders without a prediction too


# ---------------------------------------------------------------- real runs (committed, read-only)


@pytest.mark.parametrize("run", GPU_RUNS, ids=lambda run: run.name)
def test_the_committed_h200_run_passes(run):
    report = load(AcceptanceReport, run / "acceptance.json")
    summary = load(TrainingSummary, run / "training.json")
    result = judge(summary.final_val_full_acc, report.trained.per_position_acceptance,
                   num_drafts=report.trained.num_drafts)  # fmt: skip
    assert result.verdict == "passed", result
    assert result.ratio[0] > 2.5 * RULE["min_ratio"]  # 0.70: a wide margin
    # the untrained baseline served 0 where nothing was predicted of it; claimed as the trained draft's, it fails
    claimed = judge(summary.final_val_full_acc, report.untrained.per_position_acceptance, num_drafts=1000)
    assert claimed.verdict == "failed"


# ---------------------------------------------------------------- the stage's wiring


def test_the_stage_reads_the_drafts_own_training_json(tmp_path):
    trained = acceptance_report().trained  # served 0.7 / 0.5 / 0.3, 100 drafts
    draft = tmp_path / "draft"
    draft.mkdir()
    assert train_serve_consistency(draft, trained, DEFAULTS).verdict == "not judged"
    write(draft / "training.json", training_summary(draft))  # validation 0.4 / 0.18
    assert train_serve_consistency(draft, trained, DEFAULTS).verdict == "passed"
    claimed = training_summary(draft).model_copy(update={"final_val_full_acc": [0.95, 0.9, 0.85]})
    write(draft / "training.json", claimed)
    collapsed = trained.model_copy(update={"per_position_acceptance": [0.2, 0.1, 0.0]})
    result = train_serve_consistency(draft, collapsed, DEFAULTS)
    assert result.verdict == "failed"
    assert result.predicted == [0.95, 0.9, 0.85]


# ---------------------------------------------------------------- absolute paths in measurement specs


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_a_spec_built_from_relative_paths_holds_only_absolute_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("results/r/target", "results/r/draft", "results/r/eval/work"):
        (tmp_path / folder).mkdir(parents=True)
    vllm = tiny_settings(ServingStage).vllm
    engine = measurement_engine_kwargs(vllm, target="results/r/target", dtype="bfloat16", trust_remote_code=False,
                                       seed=0, device="cpu", tensor_parallel_size=1, in_process=True)  # fmt: skip
    spec_fields = dict(prompts=[[1, 2, 3]], max_tokens=8, timing_repeats=1, stop_token_ids=[2], stop=[],
                       timing_concurrency=[1], timing_prompts=1)  # fmt: skip
    runs = [
        keyed_run(run, engine, spec_fields, batch_invariant=False, work_dir=Path("results/r/eval/work"))
        for run in (MeasurementRun(label="no_speculation", speculative_config=None),
                    eagle3_run("trained", Path("results/r/draft"), 3))
    ]  # fmt: skip
    spec = MeasurementSpec(engine=engine, runs=runs, **spec_fields)
    paths = [s for s in _strings(spec.model_dump(mode="json")) if "results/r" in s]
    assert len(paths) == 4, paths  # the target, the draft, two result files
    assert all(os.path.isabs(p) for p in paths), paths
    assert spec.engine["model"] == str(tmp_path / "results/r/target")
    # the same spec from another working directory names the same folders
    monkeypatch.chdir("/")
    assert Path(spec.engine["model"]).is_dir()
    assert Path(spec.runs[1].speculative_config["model"]).is_dir()


def test_lossless_fault_reads_an_older_relative_spec_from_the_runs_working_directory(tmp_path):
    loaded = importlib.util.spec_from_file_location("lossless_fault", REPO / "bench/gpu/lossless_fault.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    old = MeasurementSpec(engine={"model": "results/r/target"}, prompts=[[1]], max_tokens=1, timing_repeats=1,
                          runs=[MeasurementRun(label="no_speculation", speculative_config=None),
                                MeasurementRun(label="trained", speculative_config={"model": "results/r/draft"})])  # fmt: skip
    fixed = module.absolute_paths(old, workdir=tmp_path)
    assert fixed.engine["model"] == str(tmp_path / "results/r/target")
    assert fixed.runs[1].speculative_config["model"] == str(tmp_path / "results/r/draft")
    assert module.absolute_paths(fixed, workdir=Path("/elsewhere")) == fixed  # absolute ones stay
