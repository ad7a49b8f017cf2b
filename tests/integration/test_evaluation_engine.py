"""evaluate_draft for real: a failing measurement process quotes its traceback; (slow) the rule with vLLM CPU
serving a tiny target with a draft built from scratch and an untrained baseline writes acceptance.json with sane
numbers and lossless=True; vLLM's n-gram proposer exercises the accept path. The pure parts: tests/unit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import evaluation, rules_run, run_workflow, synthetic_run_config, tiny_settings
from synthetic_run import build_scratch_draft, write_synthetic_run

from eagle3_workflow.artefacts import AcceptanceReport, load
from eagle3_workflow.errors import StageError
from eagle3_workflow.evaluation.launch import (
    measurement_engine_kwargs,
    measurement_environment,
    run_measurement_process,
)
from eagle3_workflow.evaluation.lossless import compare_greedy
from eagle3_workflow.evaluation.metrics import acceptance_result
from eagle3_workflow.evaluation.prompts import load_prompts
from eagle3_workflow.evaluation.protocol import MeasurementRun, MeasurementSpec
from eagle3_workflow.settings import ServingStage

VLLM_SETTINGS = tiny_settings(ServingStage).vllm  # the vllm section of a tiny run (CPU)


# ---------------------------------------------------------------- the measurement process


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the bad spec is written unchecked on purpose
def test_a_failing_measurement_process_quotes_its_traceback(tmp_path):
    # prompts that are not token ids, written unchecked: the child's artefacts.load refuses the spec before it
    # imports vLLM, and exits 1 with the cause and its traceback in the log
    spec = MeasurementSpec.model_construct(engine={}, prompts=["not token ids"], max_tokens=4, timing_repeats=1,
                                           runs=[], top_logprobs=5, stop_token_ids=[], stop=[])  # fmt: skip
    env = measurement_environment(device="cpu", cpu_threads=None, in_process=True)
    log_path = tmp_path / "eval.log"
    with pytest.raises(StageError) as failure:
        run_measurement_process(spec, tmp_path, "m", env=env, log_path=log_path, timeout_s=120)
    message = str(failure.value)
    assert "exited with code 1" in message
    assert "Traceback (most recent call last)" in message
    assert "ArtefactError" in message
    assert "m.spec.json is not a valid MeasurementSpec" in message
    assert "prompts.0: Input should be a valid list" in message
    assert "[eval-vllm]" in log_path.read_text()


@pytest.fixture(scope="module")
def scratch_draft(prepared, tmp_path_factory):
    return build_scratch_draft(prepared["target"], prepared["token_freq"], tmp_path_factory.mktemp("draft") / "d")


# ---------------------------------------------------------------- the rule, for real (vLLM CPU)


@pytest.mark.slow
def test_evaluate_draft_rule_measures_acceptance_and_proves_lossless(scratch_draft, prepared, tmp_path):
    target = Path(prepared["target"])
    write_synthetic_run(tmp_path, "t", target=target, prepared=prepared["prepared"], draft=scratch_draft,
                        training_metrics=None)  # fmt: skip
    config = synthetic_run_config(target, train={"train_data_ratio": 0.75},
                                  evaluate={"num_prompts": 8, "max_tokens": 24, "num_speculative_tokens": 3, "timing_repeats": 1})  # fmt: skip
    proc = run_workflow(tmp_path, config, targets=["results/t/eval/acceptance.json"],
                        extra=["--rerun-triggers=mtime"], timeout=900)  # fmt: skip
    assert rules_run(proc) == ["evaluate_draft"]

    report = load(AcceptanceReport, tmp_path / "results/t/eval/acceptance.json")
    assert report.lossless
    assert report.lossless_mismatches == 0
    assert report.num_prompts == 8
    assert report.prompt_source == "heldout"
    assert report.device == "cpu"
    assert report.vllm_version
    assert report.no_speculation_tokens_per_s > 0
    k = report.num_speculative_tokens
    for result in (report.trained, report.untrained):
        assert 1.0 <= result.mean_acceptance_length <= 1 + k
        assert result.num_drafts > 0
        assert result.draft_tokens == result.num_drafts * k
        assert sum(result.accepted_per_position) == result.accepted_tokens
        rates = result.per_position_acceptance
        assert len(rates) == k
        assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # needs the earlier
        assert result.generated_tokens == report.no_speculation_generated_tokens  # same greedy text
        assert result.tokens_per_s > 0
        assert result.engine_start_s > 0
    assert len(report.processes) == 1
    assert report.processes[0].runs == ["no_speculation", "trained", "untrained"]
    assert (tmp_path / "results/t/eval/work/untrained_draft/model.safetensors").exists()
    log = (tmp_path / "results/t/logs/evaluate_draft.log").read_text()
    assert "[eval-vllm]" in log
    assert "stage evaluate_draft: done" in log
    print(report.model_dump_json(indent=1)[:3000], file=sys.stderr)


@pytest.mark.slow
def test_accepted_drafts_are_counted_per_position_and_stay_lossless(prepared, tiny_tokenizer, tmp_path):
    """An untrained EAGLE-3 draft accepts nothing, which leaves the accept path untested: vLLM's n-gram
    proposer (prompt lookup) gets real acceptances on the tiny target's repetitive greedy text, through the same
    measurement process, counters and lossless diff."""
    settings = evaluation(prompts="heldout", num_prompts=4, max_tokens=32)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=prepared["prepared"], train_data_ratio=0.5,
                              max_model_len=512)  # fmt: skip
    engine = measurement_engine_kwargs(VLLM_SETTINGS, target=str(prepared["target"]), dtype="bfloat16", trust_remote_code=False,
                           seed=0, device="cpu", tensor_parallel_size=1, in_process=True)  # fmt: skip
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec = MeasurementSpec(engine=engine, prompts=[p.token_ids for p in prompt_set.prompts], max_tokens=32,
                           timing_repeats=1, runs=[MeasurementRun(label="no_speculation", speculative_config=None),
                                                   MeasurementRun(label="ngram", speculative_config=ngram)])  # fmt: skip
    env = measurement_environment(device="cpu", cpu_threads=2, in_process=True)
    result, _ = run_measurement_process(spec, tmp_path, "ngram", env=env, log_path=tmp_path / "log", timeout_s=600)
    reference, run = result.runs
    mismatches = compare_greedy(reference.outputs, run.outputs, origins=[p.origin for p in prompt_set.prompts],
                                reference_logprobs=reference.logprobs, tolerance=0.0)  # fmt: skip
    accepted = acceptance_result(run, draft_path=Path("ngram"), num_speculative_tokens=3, reference=reference,
                                 mismatches=mismatches)  # fmt: skip
    assert mismatches == []
    assert accepted.lossless
    assert accepted.accepted_tokens > 0
    assert accepted.mean_acceptance_length > 1.0
    assert accepted.mean_acceptance_length == pytest.approx(1 + sum(accepted.per_position_acceptance))
    rates = accepted.per_position_acceptance
    assert rates[0] > 0
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    print(f"ngram: acceptance length {accepted.mean_acceptance_length:.3f}, per position {rates}", file=sys.stderr)
