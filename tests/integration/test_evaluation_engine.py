"""evaluate_draft for real: a failing measurement process quotes its traceback; (slow) the rule with vLLM CPU
serving a tiny target with a draft built from scratch and an untrained baseline writes acceptance.json with sane
numbers and lossless=True; vLLM's n-gram proposer exercises the accept path. The pure parts: tests/unit."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, evaluation, rules_run, run_workflow, shift_d2t, synthetic_run_config, tiny_settings
from synthetic_run import build_scratch_draft, write_synthetic_run

from eagle3_workflow.evaluation.launch import (
    measurement_engine_kwargs,
    measurement_environment,
    run_measurement_process,
)
from eagle3_workflow.evaluation.lossless import compare_greedy, non_argmax_steps
from eagle3_workflow.evaluation.metrics import acceptance_result
from eagle3_workflow.evaluation.prompts import load_prompts
from eagle3_workflow.evaluation.protocol import MeasurementRun, MeasurementSpec
from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.draft_artefacts import AcceptanceReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ServingStage

VLLM_SETTINGS = tiny_settings(ServingStage).vllm  # the vllm section of a tiny run (CPU)
FAULT_PLUGINS = str(REPO / "tests" / "fault_plugins")


# ---------------------------------------------------------------- the measurement process


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the bad spec is written unchecked on purpose
def test_a_failing_measurement_process_quotes_its_traceback(tmp_path):
    # prompts that are not token ids, written unchecked: the child's artefacts.load refuses the spec before it
    # imports vLLM, and exits 1 with the cause and its traceback in the log
    spec = MeasurementSpec.model_construct(engine={}, prompts=["not token ids"], max_tokens=4, timing_repeats=1,
                                           runs=[], top_logprobs=5, stop_token_ids=[], stop=[],
                                           timing_concurrency=[1], timing_prompts=None)  # fmt: skip
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
    target = Path(shutil.copytree(prepared["target"], tmp_path / "target"))  # the synthetic run ages its target
    write_synthetic_run(tmp_path, "t", target=target, prepared=prepared["prepared"], draft=scratch_draft,
                        training_metrics=None)  # fmt: skip
    config = synthetic_run_config(tmp_path, target, train={"train_data_ratio": 0.75},
                                  evaluate={"num_prompts": 8, "max_tokens": 24, "num_speculative_tokens": 3, "timing_repeats": 1,
                                            "time_untrained": True})  # both drafts timed (the tiny preset times the trained one only)  # fmt: skip
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
        assert result.tokens_per_s > 0
        assert result.engine_start_s > 0
    # same greedy text, every prompt counted
    assert (report.trained.generated_tokens, report.trained.acceptance_prompts, report.trained.no_speculation_divergences) == (
        report.no_speculation_generated_tokens, None, [])  # fmt: skip
    # the trained draft's output equals the one without speculation on every prompt: the untrained draft (the CPU
    # reference) generated only its first evaluate.untrained_prompts (4, its acceptance), no prompt more
    untrained = report.untrained
    assert (report.lossless_reference, untrained.acceptance_prompts, untrained.reference_prompts) == (
        "untrained", [0, 1, 2, 3], [])  # fmt: skip
    assert len(report.processes) == 1
    assert report.processes[0].runs == [f"{label} (production)" for label in ("no_speculation", "trained", "untrained")]
    assert report.lossless_numerics == "production"
    assert report.lossless_criterion.startswith("exact")
    assert [t.concurrency for t in report.no_speculation_throughput] == [1, 8]
    assert (tmp_path / "results/t/eval/work/untrained_draft/model.safetensors").exists()
    log = (tmp_path / "results/t/logs/evaluate_draft.log").read_text()
    assert "[eval-vllm]" in log
    assert "stage evaluate_draft: done" in log
    # the measurement process was started before the prompts and the untrained draft, and it is the one that ran
    assert log.index("the measurement process (no_speculation, trained, untrained), started before its spec") < (
        log.index("untrained baseline (built): ")
    )
    assert "started early, is not the process" not in log and "started early, got no spec" not in log
    assert log.count(" imported in ") == 1 and log.count("measurement process measure_0 done") == 1
    assert "differs from the run without speculation on 0 of 8 prompt(s): no reference needed" in log
    # the draft parity's steps came from the trained draft's lossless pass (its first 4 prompts, stepped through the
    # engine), not from a second generation of them, and the check passed on them
    assert "parity pass within the lossless pass: its first 4 prompt(s)" in log and "parity pass: " not in log
    assert report.parity is not None and (report.parity.verdict, report.parity.prompts) == ("passed", [0, 1, 2, 3])
    assert report.parity.steps_compared > 0 and report.parity.proposals_compared > 0
    print(report.model_dump_json(indent=1)[:3000], file=sys.stderr)

    # a rerun with nothing changed (as after a cut later in the stage) measures nothing again
    run_workflow(tmp_path, config, targets=["results/t/eval/acceptance.json"],
                 extra=["--rerun-triggers=mtime", "--forcerun", "evaluate_draft"], timeout=900)  # fmt: skip
    again = load(AcceptanceReport, tmp_path / "results/t/eval/acceptance.json")
    assert again.processes == []
    assert again.trained.mean_acceptance_length == report.trained.mean_acceptance_length
    log = (tmp_path / "results/t/logs/evaluate_draft.log").read_text()
    # and the untrained draft is not built again (its files' mtimes are part of the keys at the 8B shape)
    assert log.count("reusing ") == 3 and "untrained baseline (kept: built by an earlier attempt" in log
    assert "measure_0, started early, got no spec (every run's result reused" in log


@pytest.mark.slow
def test_a_served_draft_with_a_shifted_d2t_fails_the_consistency_gate(scratch_draft, prepared, tmp_path):
    """Train/serve consistency for real: the synthetic run's training.json says the draft validated at full_acc_0
    0.40 (TRAINING_METRICS), the served draft's d2t is shifted by one id, vLLM serves it at ~0 position-0
    acceptance, and evaluate_draft fails naming the d2t/t2d mapping among the causes; acceptance.json is not
    written. (A scratch draft serves ~0 either way: the healthy side of the rule is shown on the committed real
    runs, tests/unit/test_consistency.py.)"""
    draft = Path(shutil.copytree(scratch_draft, tmp_path / "shifted_draft"))
    shift_d2t(draft / "model.safetensors")
    target = Path(shutil.copytree(prepared["target"], tmp_path / "target"))
    write_synthetic_run(tmp_path, "t", target=target, prepared=prepared["prepared"], draft=draft)
    config = synthetic_run_config(tmp_path, target, train={"train_data_ratio": 0.75},
                                  evaluate={"num_prompts": 4, "max_tokens": 16, "num_speculative_tokens": 3, "timing_repeats": 1})  # fmt: skip
    proc = run_workflow(tmp_path, config, targets=["results/t/eval/acceptance.json"],
                        extra=["--rerun-triggers=mtime"], check=False, timeout=900)  # fmt: skip
    assert proc.returncode != 0
    assert not (tmp_path / "results/t/eval/acceptance.json").exists()
    log = (tmp_path / "results/t/logs/evaluate_draft.log").read_text()
    assert "train/serve consistency FAILED" in log, log[-4000:]
    assert "a regenerated or misaligned d2t/t2d vocabulary mapping" in log
    failed = load(AcceptanceReport, tmp_path / "results/t/eval/work/acceptance_failed.json")
    assert failed.lossless  # the shifted draft is still verified: only the consistency gate can see it
    consistency = failed.consistency
    assert consistency is not None and consistency.verdict == "failed"
    assert consistency.predicted == [0.4, 0.18]
    assert consistency.served[0] < 0.25 * 0.4
    assert consistency.num_drafts >= 20
    print(consistency.model_dump_json(indent=1), file=sys.stderr)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _ngram_measurement(prepared, tiny_tokenizer, work_dir, runs: list[MeasurementRun], reference=None):
    """vLLM's n-gram proposer (prompt lookup: real acceptances on the tiny target's repetitive greedy text, where an
    untrained EAGLE-3 draft accepts nothing) in one measurement process, as the stage runs them on CPU: the lossless
    pass and the timing passes on one engine each. `runs`: the no-speculation reference and then the n-gram run, or
    the n-gram run alone, judged against `reference` (a no-speculation run of the same spec: the fault below changes
    only speculative decoding, so the healthy process's reference is its reference too, one engine fewer)."""
    settings = evaluation(prompts="heldout", num_prompts=4, max_tokens=32)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=prepared["prepared"], train_data_ratio=0.5,
                              max_model_len=512)  # fmt: skip
    engine = measurement_engine_kwargs(VLLM_SETTINGS, target=str(prepared["target"]), dtype="bfloat16", trust_remote_code=False,
                           seed=0, device="cpu", tensor_parallel_size=1, in_process=True)  # fmt: skip
    spec = MeasurementSpec(engine=engine, prompts=[p.token_ids for p in prompt_set.prompts], max_tokens=32,
                           timing_repeats=1, timing_concurrency=[1, 2], timing_prompts=2, runs=runs)  # fmt: skip
    env = measurement_environment(device="cpu", cpu_threads=2, in_process=True)
    result, _ = run_measurement_process(spec, work_dir, "ngram", env=env, log_path=work_dir / "log", timeout_s=600)
    reference, run = (reference, *result.runs) if reference is not None else result.runs
    mismatches = compare_greedy((reference.outputs, reference.top_logits), (run.outputs, run.top_logits),
                                origins=[p.origin for p in prompt_set.prompts], dtype="bfloat16", tie_steps=0)  # fmt: skip
    wrong = non_argmax_steps(run.outputs, run.top_logits, "bfloat16") + non_argmax_steps(
        reference.outputs, reference.top_logits, "bfloat16"
    )
    accepted = acceptance_result(run, run if run.timings else None, draft_path=Path("ngram"),
                                 num_speculative_tokens=3, reference_timing=reference, mismatches=mismatches,
                                 non_argmax=wrong)  # fmt: skip
    return reference, accepted


RAW_LOGITS = {"logprobs_mode": "raw_logits"}


@pytest.fixture(scope="module")
def ngram_measurement(prepared, tiny_tokenizer, tmp_path_factory):
    """No speculation and the n-gram proposer, healthy, in one measurement process: (reference, accepted)."""
    runs = [MeasurementRun(label="no_speculation", speculative_config=None, engine_overrides=RAW_LOGITS),
            MeasurementRun(label="ngram", speculative_config=NGRAM, engine_overrides=RAW_LOGITS)]  # fmt: skip
    return _ngram_measurement(prepared, tiny_tokenizer, tmp_path_factory.mktemp("ngram"), runs)


@pytest.mark.slow
def test_accepted_drafts_are_counted_per_position_and_stay_lossless(ngram_measurement):
    """The accept path through the same measurement process, counters and lossless judge as the stage."""
    reference, accepted = ngram_measurement
    assert accepted.mismatches == []
    assert accepted.non_argmax_steps == []
    assert accepted.lossless
    assert accepted.accepted_tokens > 0
    assert accepted.mean_acceptance_length > 1.0
    assert accepted.mean_acceptance_length == pytest.approx(1 + sum(accepted.per_position_acceptance))
    rates = accepted.per_position_acceptance
    assert rates[0] > 0
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    # every step carries the raw logits of its top-k (the emitted token among them)
    assert all(token in step for ids, steps in zip(reference.outputs, reference.top_logits, strict=True)
               for token, step in zip(ids, steps, strict=True))  # fmt: skip
    assert [t.concurrency for t in accepted.throughput] == [1, 2]
    assert all(t.tokens_per_s > 0 and t.prompts == 2 for t in accepted.throughput)
    assert accepted.throughput[0].ms_per_step > 0
    print(f"ngram: acceptance length {accepted.mean_acceptance_length:.3f}, per position {rates}", file=sys.stderr)


@pytest.mark.slow
def test_a_wrongly_accepted_draft_token_fails_the_lossless_check(
    ngram_measurement, prepared, tiny_tokenizer, tmp_path, monkeypatch
):
    """Fault injection (tests/fault_plugins, EAGLE3_FAULT=accept_any_draft): vLLM's verification accepts every
    proposed token. The check must fail on the emitted tokens that are not the speculative run's own argmax, even
    with a tie allowance, and name them. The n-gram run alone runs under the fault (no timing pass: nothing here
    reads it); its reference is the healthy process's run without speculation, which the fault cannot touch."""
    monkeypatch.setenv("EAGLE3_FAULT", "accept_any_draft")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FAULT_PLUGINS, os.environ.get("PYTHONPATH")])))
    ngram = MeasurementRun(label="ngram", speculative_config=NGRAM, engine_overrides=RAW_LOGITS, timing_pass=False)
    _, accepted = _ngram_measurement(prepared, tiny_tokenizer, tmp_path, [ngram], reference=ngram_measurement[0])
    assert not accepted.lossless
    assert accepted.non_argmax_steps, "the wrongly accepted tokens are not the verifier's argmax"
    assert "argmax" in accepted.non_argmax_steps[0]
    assert accepted.mismatches, "accepting every n-gram guess changes the greedy output"
    assert not any(m.tie for m in accepted.mismatches)


@pytest.mark.slow
def test_the_lossless_pass_gives_the_parity_pass_its_steps_as_a_pass_of_its_own_would(
    scratch_draft, prepared, tiny_tokenizer, tmp_path
):
    """The trained draft's lossless pass (one prompt at a time) steps its first prompts through the engine and
    records the parity pass's facts from them (measure.parity_in_lossless) instead of generating them again: the
    same tokens, steps and proposals as a parity pass of its own (another engine, DELTA outputs, no logprobs), and
    those prompts' lossless outputs are the stepped ones."""
    from eagle3_workflow.evaluation.protocol import eagle3_run
    from eagle3_workflow.files.chat import assistant_stop_set

    settings = evaluation(prompts="heldout", num_prompts=3, max_tokens=24)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=prepared["prepared"], train_data_ratio=0.5,
                              max_model_len=512)  # fmt: skip
    stop = assistant_stop_set(tiny_tokenizer)
    engine = measurement_engine_kwargs(VLLM_SETTINGS, target=str(prepared["target"]), dtype="bfloat16",
                                       trust_remote_code=False, seed=0, device="cpu", tensor_parallel_size=1,
                                       in_process=True)  # fmt: skip
    run = eagle3_run("trained", scratch_draft, 3).model_copy(update={"parity_prompts": 2, "timing_pass": False})
    apart = run.model_copy(update={"label": "apart", "lossless_pass": False})
    within = run.model_copy(update={"label": "within", "lossless_alone": True,
                                    "engine_overrides": {"logprobs_mode": "raw_logits"}})  # fmt: skip
    spec = MeasurementSpec(engine=engine, prompts=[p.token_ids for p in prompt_set.prompts], max_tokens=24,
                           timing_repeats=1, runs=[apart, within], stop_token_ids=stop.token_ids,
                           stop=stop.strings)  # fmt: skip
    assert not stop.strings  # the tiny target's answers end at token ids only: the parity pass's own stop
    env = measurement_environment(device="cpu", cpu_threads=2, in_process=True) | {"VLLM_CPU_ATTN_SPLIT_KV": "0"}
    result, _ = run_measurement_process(spec, tmp_path, "parity", env=env, log_path=tmp_path / "log", timeout_s=600)
    separate, stepped = result.runs
    assert separate.outputs == [] and len(stepped.outputs) == 3
    assert stepped.parity_outputs == separate.parity_outputs and len(stepped.parity_outputs) == 2
    assert stepped.parity_steps == separate.parity_steps and sum(map(len, stepped.parity_steps)) > 10
    assert stepped.parity_proposals == separate.parity_proposals and stepped.parity_proposals
    assert stepped.outputs[:2] == stepped.parity_outputs
    assert [len(steps) for steps in stepped.top_logits] == [len(ids) for ids in stepped.outputs]  # logits kept
    log = (tmp_path / "log").read_text()
    assert log.count("parity pass within the lossless pass: its first 2 prompt(s)") == 1
    assert log.count("  parity pass: 2 prompt(s)") == 1  # the apart run's own


@pytest.mark.slow
def test_a_wrongly_accepted_eagle3_draft_fails_the_cpu_verdict_with_its_margin(
    scratch_draft, prepared, tiny_tokenizer, tmp_path, monkeypatch
):
    """Fault injection through the stage's own CPU lossless plan, processes and verdict (reference: the untrained
    draft's run, both speculative passes one prompt at a time, vLLM's KV split off): with
    EAGLE3_FAULT=accept_any_draft vLLM accepts every EAGLE-3 draft token. The trained draft's output then differs
    from the run without speculation, so the untrained draft generates those prompts too, in a second process
    (beyond its first evaluate.untrained_prompts, 1 here). Both checks fail it, with their margins in the
    AcceptanceResult: the emitted draft tokens lie steps below their step's argmax, and the two drafts' outputs
    differ."""
    from eagle3_workflow.evaluation.baseline import build_untrained_draft
    from eagle3_workflow.evaluation.judge import draft_results, lossless_verdict
    from eagle3_workflow.evaluation.measurements import (
        UNTRAINED_DIVERGENT,
        Evaluation,
        measure_runs,
        measure_untrained_reference,
    )
    from eagle3_workflow.evaluation.plan import plan_environment, plan_measurements
    from eagle3_workflow.evaluation.protocol import eagle3_run
    from eagle3_workflow.files.chat import assistant_stop_set

    monkeypatch.setenv("EAGLE3_FAULT", "accept_any_draft")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FAULT_PLUGINS, os.environ.get("PYTHONPATH")])))
    settings = evaluation(prompts="heldout", num_prompts=3, max_tokens=24, untrained_prompts=1)
    prompt_set = load_prompts(settings, tiny_tokenizer, prepared_dir=prepared["prepared"], train_data_ratio=0.5,
                              max_model_len=512)  # fmt: skip
    # another seed than the scratch draft's: two drafts that propose different tokens, as trained and untrained do
    untrained = build_untrained_draft(scratch_draft, prepared["target"], tmp_path / "untrained", 1)
    labelled = [MeasurementRun(label="no_speculation", speculative_config=None), eagle3_run("trained", scratch_draft, 3),
                eagle3_run("untrained", untrained.path, 3)]  # fmt: skip
    plan = plan_measurements(labelled, settings=settings, vllm_settings=VLLM_SETTINGS, device="cpu",
                             numerics="production", reference="untrained")  # fmt: skip
    plan[0].runs = [run.model_copy(update={"timing_pass": False}) for run in plan[0].runs]
    assert [(run.lossless_alone, run.lossless_prompts) for run in plan[0].runs] == [
        (False, None), (True, None), (True, [0])]  # fmt: skip
    engine = measurement_engine_kwargs(VLLM_SETTINGS, target=str(prepared["target"]), dtype="bfloat16",
                                       trust_remote_code=False, seed=0, device="cpu", tensor_parallel_size=1,
                                       in_process=True)  # fmt: skip
    env = plan_environment(plan, engine, settings, VLLM_SETTINGS, "cpu", reference="untrained")
    assert env["VLLM_CPU_ATTN_SPLIT_KV"] == "0" and env["EAGLE3_FAULT"] == "accept_any_draft"
    evaluation_ = Evaluation(settings, VLLM_SETTINGS, "cpu", prompt_set, assistant_stop_set(tiny_tokenizer), tmp_path)
    measured = measure_runs(plan, engine, evaluation_, log_path=tmp_path / "log", env=env, reference="untrained")
    measure_untrained_reference(measured, plan, engine, evaluation_, log_path=tmp_path / "log", env=env)
    # every prompt the trained draft changed, beyond the untrained draft's first, in a second process
    divergent = measured.lossless[UNTRAINED_DIVERGENT]
    assert divergent.prompt_indices == [1, 2] and len(measured.processes) == 2
    lossless = measured.lossless
    verdict = lossless_verdict(lossless, prompt_set, logit_dtype="bfloat16", tie_steps=0, numerics="production",
                               decode=tiny_tokenizer.decode, reference="untrained")  # fmt: skip
    measured.timing = {label: run for label, run in lossless.items() if label != UNTRAINED_DIVERGENT}
    results = draft_results(measured, verdict, {"trained": scratch_draft, "untrained": untrained.path}, 3)
    trained = results["trained"]
    margins = {label: (r.non_argmax_min_gap_steps, len(r.non_argmax_steps), len(r.mismatches))
               for label, r in results.items()}  # fmt: skip
    print(f"accept_any_draft (min gap below the argmax in bf16 steps, non-argmax tokens, prompts differing from the "
          f"untrained run): {margins}; {trained.non_argmax_steps[:2]}", file=sys.stderr)  # fmt: skip
    assert not trained.lossless and not results["untrained"].lossless
    assert trained.non_argmax_min_gap_steps is not None and trained.non_argmax_min_gap_steps > 0
    assert "bfloat16 steps below it" in trained.non_argmax_steps[0]
    assert [m.prompt_index for m in trained.no_speculation_divergences] == [0, 1, 2]
    # two drafts accepted wholesale give two outputs: the exact comparison sees it on every prompt
    assert [m.prompt_index for m in trained.mismatches] == [0, 1, 2]
    assert not any(m.tie for m in trained.mismatches)
    assert trained.accepted_tokens == trained.draft_tokens  # every proposed token accepted: the fault is in force
    assert (results["untrained"].acceptance_prompts, results["untrained"].reference_prompts) == ([0], [1, 2])
