"""Stage `evaluate_draft`: the orchestration and the Snakemake adapter `main(snakemake)`.

evaluate_draft runs the stage's three concerns in order: planning the measurements (plan: which engines, in which
processes, with which kernels and environment), running them (measurements: the processes, the early first one,
the results an earlier attempt left with the same key: resume), and judging them (judge: the lossless verdict,
each draft's results, train/serve consistency, draft parity, the report). A check that fails writes
acceptance_failed.json and raises the StageError that names its cause and fix.

A resumed attempt reuses each engine's result whose key holds (resume); the untrained draft is kept from the
attempt that built it while its recipe holds (baseline). The judgement keeps nothing and runs again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.evaluation.baseline import UntrainedDraft, build_untrained_draft
from eagle3_workflow.evaluation.consistency import consistency_failure
from eagle3_workflow.evaluation.judge import Judgement, judge_measurements, resolved_dtype
from eagle3_workflow.evaluation.launch import measurement_engine_kwargs
from eagle3_workflow.evaluation.lossless import lossless_failure
from eagle3_workflow.evaluation.measurements import Evaluation, Measured, measure_evaluation, start_first_process
from eagle3_workflow.evaluation.parity import parity_failure
from eagle3_workflow.evaluation.plan import MeasurementPlan, lossless_numerics, lossless_reference, plan_evaluation
from eagle3_workflow.evaluation.prompts import load_prompts
from eagle3_workflow.evaluation.protocol import NO_SPECULATION, MeasurementRun, eagle3_run
from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.chat import assistant_stop_set, load_chat_tokenizer
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, DraftConfig
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import EvaluateDraftStage
from eagle3_workflow.settings.views import stage_settings

log = logging.getLogger("eagle3.evaluation")


def evaluate_draft(
    stage: EvaluateDraftStage,
    *,
    target: Path,
    draft: Path,
    prepared: Path,
    work_dir: Path,
    log_path: str | Path | None = None,
) -> AcceptanceReport:
    """Measure the trained and an untrained draft against no speculation; raise StageError if not lossless."""
    from eagle3_workflow.serving.engine import resolve_device

    settings, vllm_settings = stage.evaluate, stage.vllm
    dtype, trust_remote_code = stage.target.dtype, stage.target.trust_remote_code
    # every path that goes into a measurement spec absolute: the process (or a person rerunning its spec, as
    # bench/gpu/lossless_fault.py does) may run from another directory, where vLLM reads a relative model path
    # as a hub repo id
    target, draft, prepared, work_dir = (Path(p).resolve() for p in (target, draft, prepared, work_dir))
    check_eagle3_draft(draft)
    device = resolve_device(vllm_settings.device)
    numerics = lossless_numerics(settings.lossless_numerics, device)
    reference = lossless_reference(settings.lossless_reference, device, tie_steps=settings.lossless_tie_steps)
    untrained_dir = work_dir / "untrained_draft"  # built by measure_engines, once the first process imports vLLM

    k = settings.num_speculative_tokens
    labelled = [
        MeasurementRun(label=NO_SPECULATION, speculative_config=None),
        eagle3_run("trained", draft, k).model_copy(update={"parity_prompts": settings.draft_parity_prompts}),
        eagle3_run("untrained", untrained_dir, k),
    ]
    engine = measurement_engine_kwargs(vllm_settings, target=str(target), dtype=dtype, trust_remote_code=trust_remote_code,
                           seed=settings.seed, device=device, tensor_parallel_size=settings.tensor_parallel_size,
                           in_process=settings.tensor_parallel_size == 1)  # fmt: skip
    plan = plan_evaluation(labelled, engine, settings, vllm_settings, device=device, numerics=numerics,
                           reference=reference)  # fmt: skip
    evaluation, measured, untrained, decode = measure_engines(stage, plan, target=target, draft=draft,
                                                              untrained_dir=untrained_dir, prepared=prepared,
                                                              work_dir=work_dir, device=device, reference=reference,
                                                              log_path=log_path)  # fmt: skip
    judgement = judge_measurements(measured, evaluation, draft=draft, untrained=untrained, target=target,
                                   logit_dtype=resolved_dtype(dtype, target), numerics=numerics, reference=reference,
                                   trust_remote_code=trust_remote_code, decode=decode,
                                   reference_device=stage.reference.device)  # fmt: skip
    refuse_failed_checks(judgement, evaluation, draft=draft)
    return judgement.report


def measure_engines(
    stage: EvaluateDraftStage,
    plan: MeasurementPlan,
    *,
    target: Path,
    draft: Path,
    untrained_dir: Path,
    prepared: Path,
    work_dir: Path,
    device: str,
    reference: str,
    log_path: str | Path | None,
) -> tuple[Evaluation, Measured, UntrainedDraft, Callable[[Sequence[int]], str]]:
    """The prompts, the untrained draft and the planned measurements (measure_evaluation). One after another, the
    first process is started first and imports vLLM while this one loads the prompts and the baseline. Returns the
    evaluation, what was measured, the untrained draft and the tokenizer's decode."""
    settings, vllm_settings = stage.evaluate, stage.vllm
    with contextlib.ExitStack() as early:
        first = None
        if not plan.concurrent:  # the first process imports vLLM while this one loads the prompts and the baseline
            first = early.enter_context(start_first_process(plan.processes, plan.env, settings=settings,
                                                            vllm_settings=vllm_settings, work_dir=work_dir,
                                                            log_path=log_path))  # fmt: skip
        tokenizer = load_chat_tokenizer(str(target), trust_remote_code=stage.target.trust_remote_code)
        prompt_set = load_prompts(settings, tokenizer, prepared_dir=prepared,
                                  train_data_ratio=stage.train.train_data_ratio,
                                  max_model_len=vllm_settings.max_model_len)  # fmt: skip
        log.info("%d evaluation prompts from %s", len(prompt_set.prompts), prompt_set.detail)
        stop = assistant_stop_set(tokenizer)
        log.info("answers stop at token ids %s, strings %s", stop.token_ids, stop.strings)

        untrained = build_untrained_draft(draft, target, untrained_dir, settings.seed)
        log.info("untrained baseline (%s): %s", "kept: built by an earlier attempt from the same recipe" if untrained.kept
                 else "built", untrained.description)  # fmt: skip
        evaluation = Evaluation(settings, vllm_settings, device, prompt_set, stop, work_dir, concurrent=plan.concurrent)
        measured = measure_evaluation(plan.processes, plan.engine, evaluation, log_path=log_path, env=plan.env,
                                      first=first, reference=reference)  # fmt: skip
    return evaluation, measured, untrained, tokenizer.decode


def refuse_failed_checks(judgement: Judgement, evaluation: Evaluation, *, draft: Path) -> None:
    """A failed check writes acceptance_failed.json and raises its StageError: the lossless verdict, then draft
    parity (the exact check: it names the step and the cause), then train/serve consistency."""
    report, verdict, parity, consistency = judgement.report, judgement.lossless, judgement.parity, judgement.consistency
    settings, work_dir = evaluation.settings, evaluation.work_dir
    if not report.lossless:
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(lossless_failure(verdict.judged(), verdict.non_argmax,
                                          num_prompts=len(evaluation.prompt_set.prompts),
                                          tie_steps=settings.lossless_tie_steps, numerics=verdict.numerics,
                                          reference=verdict.reference))  # fmt: skip
    if parity.verdict == "failed":  # the exact check first: it names the step and the cause
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(parity_failure(parity, draft=str(draft)))
    if consistency.verdict == "failed":
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(consistency_failure(consistency, draft=str(draft)))


def check_eagle3_draft(draft: Path) -> None:
    model_type = load(DraftConfig, draft / "config.json").speculators_model_type
    if model_type != "eagle3":
        raise StageError(
            f"{draft}/config.json has speculators_model_type {model_type!r}; "
            "this stage evaluates EAGLE-3 drafts ('eagle3')"
        )


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        settings = stage_settings(EvaluateDraftStage, snakemake.params.settings)
        # the prompt file as Snakemake resolved it (a relative path may name the copy shipped with the workflow)
        prompt_files = list(snakemake.input.get("prompt_file", []))
        if prompt_files:
            evaluate = settings.evaluate.model_copy(update={"prompt_file": prompt_files[0]})
            settings = settings.model_copy(update={"evaluate": evaluate})
        api = load(ApiCompatReport, snakemake.input.api_compat)
        if not api.passed:
            raise StageError(f"{snakemake.input.api_compat} records failed API checks; rerun check_api and fix them")
        report = evaluate_draft(
            settings,
            target=Path(snakemake.input.target),
            draft=Path(snakemake.input.draft),
            prepared=Path(snakemake.input.prepared),
            work_dir=Path(snakemake.params.work_dir),
            log_path=snakemake.log[0],
        )
        write(snakemake.output.report, report)

    run_stage("evaluate_draft", snakemake.log[0], body)
