"""Stage `evaluate_draft`: the orchestration and the Snakemake adapter `main(snakemake)`.

Three engines are measured: no speculation (the reference), the trained draft, the untrained draft. With
``evaluate.isolate_runs: null`` (the default) a CPU run does all three in one process with vLLM's engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): an engine then starts in ~3 s instead of
~15-25 s with the engine-core and worker processes (measured on the tiny target, 2 cores), and the vLLM import
(~6 s) is paid once. On GPU each engine gets its own process, so its memory is free before the next one starts;
``tensor_parallel_size > 1`` always uses vLLM's multiprocess engine.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.artefacts import (
    AcceptanceReport,
    AcceptanceResult,
    ApiCompatReport,
    DraftConfig,
    LosslessMismatch,
    MeasurementProcess,
    load,
    write,
)
from eagle3_workflow.chat import StopSet, assistant_stop_set
from eagle3_workflow.errors import StageError
from eagle3_workflow.evaluation.baseline import build_untrained_draft
from eagle3_workflow.evaluation.launch import (
    measurement_engine_kwargs,
    measurement_environment,
    run_measurement_process,
)
from eagle3_workflow.evaluation.lossless import compare_greedy, lossless_failure
from eagle3_workflow.evaluation.metrics import acceptance_result, summary_table
from eagle3_workflow.evaluation.prompts import PromptSet, load_prompts
from eagle3_workflow.evaluation.protocol import (
    NO_SPECULATION,
    MeasurementRun,
    MeasurementSpec,
    RunResult,
    eagle3_run,
)
from eagle3_workflow.settings import EvaluateDraftStage, EvaluationSettings, VllmSettings, stage_settings

log = logging.getLogger("eagle3.evaluation")

DRAFTS = ("trained", "untrained")


@dataclasses.dataclass
class Measured:
    """What the measurement processes returned: every run by label, each process's timings, vLLM's version."""

    by_label: dict[str, RunResult]
    processes: list[MeasurementProcess]
    vllm_version: str = ""


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
    from transformers import AutoTokenizer

    from eagle3_workflow.vllm_server import resolve_device

    settings, vllm_settings = stage.evaluate, stage.vllm
    dtype, trust_remote_code = stage.target.dtype, stage.target.trust_remote_code
    check_eagle3_draft(draft)
    device = resolve_device(vllm_settings.device)
    tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    prompt_set = load_prompts(settings, tokenizer, prepared_dir=prepared, train_data_ratio=stage.train.train_data_ratio,
                              max_model_len=vllm_settings.max_model_len)  # fmt: skip
    log.info("%d evaluation prompts from %s", len(prompt_set.prompts), prompt_set.detail)
    stop = assistant_stop_set(tokenizer)
    log.info("answers stop at token ids %s, strings %s", stop.token_ids, stop.strings)

    untrained = build_untrained_draft(draft, target, work_dir / "untrained_draft", settings.seed)
    log.info("untrained baseline: %s", untrained.description)

    k = settings.num_speculative_tokens
    runs = [
        MeasurementRun(label=NO_SPECULATION, speculative_config=None),
        eagle3_run("trained", draft, k),
        eagle3_run("untrained", untrained.path, k),
    ]
    engine = measurement_engine_kwargs(vllm_settings, target=str(target), dtype=dtype, trust_remote_code=trust_remote_code,
                           seed=settings.seed, device=device, tensor_parallel_size=settings.tensor_parallel_size,
                           in_process=settings.tensor_parallel_size == 1)  # fmt: skip
    measured = measure_runs(runs, engine, prompt_set=prompt_set, stop=stop, settings=settings,
                            vllm_settings=vllm_settings, device=device, work_dir=work_dir, log_path=log_path)  # fmt: skip
    mismatches = lossless_mismatches(measured.by_label, prompt_set, settings.lossless_logprob_tolerance,
                                     decode=tokenizer.decode)  # fmt: skip
    results = draft_results(measured, mismatches, {"trained": draft, "untrained": untrained.path}, k)
    notes = prompt_set.notes + report_notes(results, mismatches, measured, settings=settings, device=device,
                                            vllm_settings=vllm_settings)  # fmt: skip
    report = build_report(results, mismatches, measured, prompt_set=prompt_set, stop=stop, settings=settings,
                          device=device, untrained_baseline=untrained.description, notes=notes)  # fmt: skip
    log.info("\n%s", summary_table(report))
    if not report.lossless:
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(lossless_failure(mismatches, len(prompt_set.prompts), settings.lossless_logprob_tolerance))
    return report


def check_eagle3_draft(draft: Path) -> None:
    model_type = load(DraftConfig, draft / "config.json").speculators_model_type
    if model_type != "eagle3":
        raise StageError(
            f"{draft}/config.json has speculators_model_type {model_type!r}; "
            "this stage evaluates EAGLE-3 drafts ('eagle3')"
        )


def measure_runs(
    runs: list[MeasurementRun],
    engine: dict[str, Any],
    *,
    prompt_set: PromptSet,
    stop: StopSet,
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    device: str,
    work_dir: Path,
    log_path: str | Path | None,
) -> Measured:
    """All runs in one measurement process, or one process per run (`evaluate.isolate_runs`; default: on GPU)."""
    isolate = settings.isolate_runs if settings.isolate_runs is not None else device != "cpu"
    groups = [[run] for run in runs] if isolate else [runs]
    env = measurement_environment(device=device, cpu_threads=vllm_settings.cpu_threads,
                                  in_process=settings.tensor_parallel_size == 1)  # fmt: skip
    measured = Measured(by_label={}, processes=[])
    for i, group in enumerate(groups):
        spec = MeasurementSpec(engine=engine, prompts=[p.token_ids for p in prompt_set.prompts],
                               max_tokens=settings.max_tokens, timing_repeats=settings.timing_repeats, runs=group,
                               stop_token_ids=stop.token_ids, stop=stop.strings)  # fmt: skip
        result, wall_s = run_measurement_process(spec, work_dir, f"measure_{i}", env=env, log_path=log_path,
                                                 timeout_s=settings.timeout_s,
                                                 stall_timeout_s=vllm_settings.stall_timeout_s)  # fmt: skip
        measured.vllm_version = result.vllm_version
        measured.by_label.update({r.label: r for r in result.runs})
        measured.processes.append(
            MeasurementProcess(
                runs=[r.label for r in group],
                wall_s=round(wall_s, 2),
                vllm_import_s=round(result.import_s, 2),
                engine_start_s={r.label: round(r.engine_start_s, 2) for r in result.runs},
                load_1m=round(os.getloadavg()[0], 2),
            )
        )
    return measured


def lossless_mismatches(
    by_label: dict[str, RunResult],
    prompt_set: PromptSet,
    tolerance: float,
    *,
    decode: Callable[[Sequence[int]], str],
) -> dict[str, list[LosslessMismatch]]:
    """The first divergences of each draft's greedy output from the reference's, per prompt."""
    reference = by_label[NO_SPECULATION]
    origins = [p.origin for p in prompt_set.prompts]
    return {
        label: compare_greedy(
            reference.outputs,
            by_label[label].outputs,
            origins=origins,
            reference_logprobs=reference.logprobs,
            tolerance=tolerance,
            decode=decode,
        )  # fmt: skip
        for label in DRAFTS
    }


def draft_results(
    measured: Measured,
    mismatches: dict[str, list[LosslessMismatch]],
    draft_paths: dict[str, Path],
    num_speculative_tokens: int,
) -> dict[str, AcceptanceResult]:
    """Each draft's acceptance, speed-up over the reference and lossless verdict."""
    return {
        label: acceptance_result(
            measured.by_label[label],
            draft_path=Path(path),
            num_speculative_tokens=num_speculative_tokens,
            reference=measured.by_label[NO_SPECULATION],
            mismatches=mismatches[label],
        )
        for label, path in draft_paths.items()
    }


def build_report(
    results: dict[str, AcceptanceResult],
    mismatches: dict[str, list[LosslessMismatch]],
    measured: Measured,
    *,
    prompt_set: PromptSet,
    stop: StopSet,
    settings: EvaluationSettings,
    device: str,
    untrained_baseline: str,
    notes: list[str],
) -> AcceptanceReport:
    """eval/acceptance.json from the measured runs."""
    reference = measured.by_label[NO_SPECULATION]
    return AcceptanceReport(
        num_prompts=len(prompt_set.prompts),
        prompt_source=prompt_set.source,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_tokens=settings.max_tokens,
        trained=results["trained"],
        untrained=results["untrained"],
        no_speculation_tokens_per_s=reference.tokens_per_s,
        lossless=all(r.lossless for r in results.values()),
        lossless_mismatches=sum(len(ms) for ms in mismatches.values()),
        num_prompts_requested=prompt_set.requested,
        prompt_detail=prompt_set.detail,
        device=device,
        vllm_version=measured.vllm_version,
        no_speculation_generated_tokens=reference.generated_tokens,
        no_speculation_generate_s=reference.generate_s,
        no_speculation_engine_start_s=reference.engine_start_s,
        lossless_logprob_tolerance=settings.lossless_logprob_tolerance,
        untrained_baseline=untrained_baseline,
        processes=measured.processes,
        notes=notes,
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )


def report_notes(
    results: dict[str, AcceptanceResult],
    mismatches: dict[str, list[LosslessMismatch]],
    measured: Measured,
    *,
    settings: EvaluationSettings,
    device: str,
    vllm_settings: VllmSettings,
) -> list[str]:
    """What a reader of the numbers must know: tolerated near-ties, a draft that does not beat its baseline,
    CPU timing, server flags that an offline engine does not take."""
    notes = []
    tolerated = sum(m.tolerated for ms in mismatches.values() for m in ms)
    if tolerated:
        notes.append(
            f"{tolerated} mismatch(es) tolerated as numerical near-ties (reference logprob gap <= "
            f"{settings.lossless_logprob_tolerance})"
        )
    if results["trained"].mean_acceptance_length <= results["untrained"].mean_acceptance_length:
        notes.append(
            f"the trained draft does not beat the untrained baseline (mean acceptance length "
            f"{results['trained'].mean_acceptance_length:.3f} vs {results['untrained'].mean_acceptance_length:.3f})"
        )
    if device == "cpu":
        notes.append(
            "tokens/s measured on CPU (host load average "
            + ", ".join(str(p.load_1m) for p in measured.processes)
            + "): indicative only; acceptance does not depend on timing"
        )
    if vllm_settings.extra_args:
        notes.append(f"vllm.extra_args {list(vllm_settings.extra_args)} are server flags and were not applied here")
    return notes


def main(snakemake: Any) -> None:
    from eagle3_workflow.gpu_placement import holding_gpus
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
