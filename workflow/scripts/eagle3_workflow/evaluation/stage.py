"""Stage `evaluate_draft`: the orchestration and the Snakemake adapter `main(snakemake)`.

Three engines are measured: no speculation (the reference), the trained draft, the untrained draft. With
``evaluate.isolate_runs: null`` (the default) a CPU run does all three in one process with vLLM's engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): an engine then starts in ~3 s instead of
~15-25 s with the engine-core and worker processes (measured on the tiny target, 2 cores), and the vLLM import
(~6 s) is paid once. On GPU each engine gets its own process, so its memory is free before the next one starts;
``tensor_parallel_size > 1`` always uses vLLM's multiprocess engine.

On CUDA with a fixed KV cache (``evaluate.concurrent_processes: null``, concurrent_processes()) those processes
start all at once: their imports and engine starts (torch.compile, CUDA graphs: most of a 135M target's
evaluation) overlap, and a lock file keeps each timing pass alone (measure.Gate). Each engine passes vLLM's
start-up free-memory check beside the others with its share of the GPU (engine_memory()).

With the untrained draft as the lossless reference (CPU, stage.lossless_reference) the untrained draft generates
only its first ``evaluate.untrained_prompts`` prompts in that process (its acceptance) and, in one more process
afterwards, each other prompt where the trained draft's greedy output differs from the run without speculation
(measure_untrained_reference): where the two are equal token for token the trained draft is lossless by definition
and nothing needs the reference. Accepting nothing, the untrained draft costs k draft forwards and a 1 + k-row
verification per token: on the SmolLM2 demo its pass of all 32 prompts was 177 s of the stage's 461 s (2026-12-06).

Processes that run one after another: the first is started before the stage loads the tokenizer and prompts and
builds the untrained draft (start_first_process, runtime.worker.start_worker), so its vLLM import runs beside that
work; it gets its spec once the prompts are known, or is stopped when an earlier attempt's results leave it nothing
to do.

A resumed attempt reuses each engine's result whose key (keyed_run: the engine, the passes, the prompts, the models'
fingerprints) holds. The untrained draft is kept from the attempt that built it while its recipe holds (baseline):
rebuilt, its 1.77 GiB of weights at the 8B shape (fingerprinted by size:mtime) changed both untrained engines' keys
and each resume measured them again (H100, 2026-12-06). The judgement after the engines (the lossless verdict, the
train/serve consistency, draft parity with its fp32 reference of the whole target) keeps nothing and runs again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_workflow.artefacts import (
    AcceptanceReport,
    AcceptanceResult,
    ApiCompatReport,
    DraftConfig,
    LosslessMismatch,
    MeasurementProcess,
    Throughput,
    TrainingSummary,
    TrainServeConsistency,
    load,
    write,
)
from eagle3_workflow.chat import StopSet, assistant_stop_set, load_chat_tokenizer
from eagle3_workflow.errors import StageError
from eagle3_workflow.evaluation.baseline import build_untrained_draft
from eagle3_workflow.evaluation.consistency import consistency_failure, consistency_table, judge_consistency
from eagle3_workflow.evaluation.fingerprint import model_fingerprint
from eagle3_workflow.evaluation.launch import (
    Launch,
    measurement_engine_kwargs,
    measurement_environment,
    run_measurement_process,
    run_measurement_processes,
)
from eagle3_workflow.evaluation.lossless import compare_greedy, lossless_failure, non_argmax_gaps, non_argmax_steps
from eagle3_workflow.evaluation.metrics import acceptance_result, summary_table, throughput
from eagle3_workflow.evaluation.parity import draft_parity, parity_failure
from eagle3_workflow.evaluation.prompts import PromptSet, load_prompts
from eagle3_workflow.evaluation.protocol import (
    LOG_PREFIX,
    NO_SPECULATION,
    MeasurementRun,
    MeasurementSpec,
    RunResult,
    eagle3_run,
    log_prefix,
)
from eagle3_workflow.settings import EvaluateDraftStage, EvaluationSettings, VllmSettings, stage_settings
from eagle3_workflow.target_config import read_target_config
from eagle3_workflow.vllm_server import cpu_engine_environment, generation_cuda_graphs

if TYPE_CHECKING:
    from eagle3_workflow.runtime.worker import StartedWorker

log = logging.getLogger("eagle3.evaluation")

DRAFTS = ("trained", "untrained")


@dataclasses.dataclass
class Measured:
    """What the measurement processes returned: each label's lossless pass and timing passes (the same engine
    with production numerics), each process's timings, vLLM's version."""

    lossless: dict[str, RunResult]
    timing: dict[str, RunResult]
    processes: list[MeasurementProcess]
    vllm_version: str = ""
    concurrent: bool = False  # the processes ran at once, each timing pass under the exclusive lock


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What every step of one evaluation shares: its settings, the device, the prompts and stop set, its work folder."""

    settings: EvaluationSettings
    vllm_settings: VllmSettings
    device: str
    prompt_set: PromptSet
    stop: StopSet
    work_dir: Path
    concurrent: bool = False  # the measurement processes start at once (concurrent_processes)


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
    from eagle3_workflow.vllm_server import resolve_device

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
    untrained_dir = work_dir / "untrained_draft"  # built below, once the first process is importing vLLM

    k = settings.num_speculative_tokens
    labelled = [
        MeasurementRun(label=NO_SPECULATION, speculative_config=None),
        eagle3_run("trained", draft, k).model_copy(update={"parity_prompts": settings.draft_parity_prompts}),
        eagle3_run("untrained", untrained_dir, k),
    ]
    engine = measurement_engine_kwargs(vllm_settings, target=str(target), dtype=dtype, trust_remote_code=trust_remote_code,
                           seed=settings.seed, device=device, tensor_parallel_size=settings.tensor_parallel_size,
                           in_process=settings.tensor_parallel_size == 1)  # fmt: skip
    plan = plan_measurements(labelled, settings=settings, vllm_settings=vllm_settings, device=device, numerics=numerics,
                             reference=reference)  # fmt: skip
    concurrent = concurrent_processes(settings, vllm_settings, device) and len(plan) > 1
    # the share of each engine comes from the plan, not from what a cut attempt left to measure: the engine's
    # kwargs are part of each result's key
    engine = engine_memory(engine, settings, vllm_settings, device=device, processes=len(plan) if concurrent else 1)
    log.info("%d measurement process(es), %s", len(plan),
             "all at once, each timing pass alone (lock file)" if concurrent else "one after another")  # fmt: skip
    # the processes' environment, taken once, now: what runs in this process meanwhile may set variables of its own
    # (torch's inductor sets TORCHINDUCTOR_CACHE_DIR when asked for its cache folder)
    env = plan_environment(plan, engine, settings, vllm_settings, device, reference=reference)
    with contextlib.ExitStack() as early:
        first = None
        if not concurrent:  # the first process imports vLLM while this one loads the prompts and the baseline
            first = early.enter_context(start_first_process(plan, env, settings=settings, vllm_settings=vllm_settings,
                                                            work_dir=work_dir, log_path=log_path))  # fmt: skip
        tokenizer = load_chat_tokenizer(str(target), trust_remote_code=trust_remote_code)
        prompt_set = load_prompts(settings, tokenizer, prepared_dir=prepared,
                                  train_data_ratio=stage.train.train_data_ratio,
                                  max_model_len=vllm_settings.max_model_len)  # fmt: skip
        log.info("%d evaluation prompts from %s", len(prompt_set.prompts), prompt_set.detail)
        stop = assistant_stop_set(tokenizer)
        log.info("answers stop at token ids %s, strings %s", stop.token_ids, stop.strings)

        untrained = build_untrained_draft(draft, target, untrained_dir, settings.seed)
        log.info("untrained baseline (%s): %s", "kept: built by an earlier attempt from the same recipe" if untrained.kept
                 else "built", untrained.description)  # fmt: skip
        evaluation = Evaluation(settings, vllm_settings, device, prompt_set, stop, work_dir, concurrent=concurrent)
        measured = measure_evaluation(plan, engine, evaluation, log_path=log_path, env=env, first=first,
                                      reference=reference)  # fmt: skip
    logit_dtype = resolved_dtype(dtype, target)
    verdict = lossless_verdict(measured.lossless, prompt_set, logit_dtype=logit_dtype, numerics=numerics,
                               tie_steps=settings.lossless_tie_steps, decode=tokenizer.decode,
                               reference=reference)  # fmt: skip
    results = draft_results(measured, verdict, {"trained": draft, "untrained": untrained.path}, k)
    notes = prompt_set.notes + report_notes(results, verdict, measured, evaluation)
    report = build_report(results, verdict, measured, evaluation, untrained_baseline=untrained.description, notes=notes)
    consistency = train_serve_consistency(draft, results["trained"], settings)
    parity = draft_parity(measured.lossless["trained"], prompt_set, draft=draft, target=target, k=k,
                          dtype=logit_dtype, trust_remote_code=trust_remote_code, decode=tokenizer.decode)  # fmt: skip
    report = report.model_copy(update={"consistency": consistency, "parity": parity})
    log.info("\n%s", summary_table(report))
    log.info(
        "train/serve consistency %s: %s\n%s", consistency.verdict, consistency.reason, consistency_table(consistency)
    )
    if not report.lossless:
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(lossless_failure(verdict.judged(), verdict.non_argmax, num_prompts=len(prompt_set.prompts),
                                          tie_steps=settings.lossless_tie_steps, numerics=numerics,
                                          reference=reference))  # fmt: skip
    if parity.verdict == "failed":  # the exact check first: it names the step and the cause
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(parity_failure(parity, draft=str(draft)))
    if consistency.verdict == "failed":
        write(work_dir / "acceptance_failed.json", report)
        raise StageError(consistency_failure(consistency, draft=str(draft)))
    return report


def train_serve_consistency(
    draft: Path, trained: AcceptanceResult, settings: EvaluationSettings
) -> TrainServeConsistency:
    """The trained draft's served acceptance against its own validation accuracy (draft/training.json, which
    train_draft writes beside the weights; a draft without one is recorded as not judged)."""
    summary_path = draft / "training.json"
    predicted = load(TrainingSummary, summary_path).final_val_full_acc if summary_path.is_file() else None
    return judge_consistency(predicted, trained.per_position_acceptance, num_drafts=trained.num_drafts,
                             min_ratio=settings.consistency_min_ratio,
                             min_predicted=settings.consistency_min_predicted)  # fmt: skip


def lossless_numerics(setting: str, device: str) -> str:
    """The kernels of the lossless pass: batch-invariant on CUDA unless the config says production."""
    if setting == "auto":
        return "batch_invariant" if device == "cuda" else "production"
    if setting == "batch_invariant" and device != "cuda":
        raise StageError(
            f"evaluate.lossless_numerics is batch_invariant but the device is {device}: vLLM's batch-invariant "
            "kernels exist for CUDA only. Use auto or production on this device (on CPU the verdict compares the "
            "two speculative runs at equal verifier numerics instead: evaluate.lossless_reference)."
        )
    return setting


def lossless_reference(setting: str, device: str, *, tie_steps: int) -> str:
    """What the trained draft's greedy output must equal (evaluate.lossless_reference): the untrained draft's run
    (auto on CPU, where no batch-invariant kernels exist) or the run without speculation (auto on CUDA). The
    untrained reference is exact by construction, so a tie allowance there is refused, not ignored."""
    resolved = setting if setting != "auto" else "no_speculation" if device == "cuda" else "untrained"
    if resolved != "no_speculation" and tie_steps:
        raise StageError(
            f"evaluate.lossless_tie_steps is {tie_steps}, but the lossless reference is the untrained draft's run "
            f"(evaluate.lossless_reference: {setting}, device {device}), which is compared exactly: both speculative "
            "runs verify the same 1 + k rows at every step, so their verifier numerics are equal and no tie can "
            "arise (docs/faults.md, 'The lossless verdict'). Remove evaluate.lossless_tie_steps (0), or set "
            "evaluate.lossless_reference: no_speculation to judge against the run without speculation with ties."
        )
    return resolved


def resolved_dtype(dtype: str, target: Path) -> str:
    """The dtype the target's logits come in: the config's, or the checkpoint's own for 'auto'."""
    if dtype != "auto":
        return dtype
    return read_target_config(target).dtype or "bfloat16"


@dataclasses.dataclass
class PlannedProcess:
    """One measurement process: its engines and whether it runs vLLM's batch-invariant kernels."""

    runs: list[MeasurementRun]
    batch_invariant: bool


def plan_measurements(
    labelled: list[MeasurementRun],
    *,
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    device: str,
    numerics: str,
    reference: str = "no_speculation",
) -> list[PlannedProcess]:
    """Which engines run in which process. Production numerics: one engine per label runs the lossless pass and
    the timing passes. Batch-invariant: each label gets a timing engine (production settings) and a lossless
    engine in batch-invariant processes, eager (its outputs are what it measures). Engines share a process unless evaluate.isolate_runs. Without
    evaluate.time_untrained the untrained baseline has no timing pass (its acceptance and lossless verdict come
    from its lossless pass either way). With the untrained draft as the lossless reference, the speculative
    engines' lossless passes generate one prompt at a time (MeasurementRun.lossless_alone)."""
    lossless_kwargs = {"logprobs_mode": "raw_logits"}
    alone = reference != NO_SPECULATION
    labelled = [
        run.model_copy(update={"lossless_alone": alone and run.speculative_config is not None}) for run in labelled
    ]
    if reference == "untrained":  # the untrained draft's first N prompts (its acceptance); the rest as needed
        first = list(range(settings.untrained_prompts))
        labelled = [run.model_copy(update={"lossless_prompts": first}) if run.label == "untrained" else run
                    for run in labelled]  # fmt: skip
    timing_kwargs: dict[str, Any] = {"max_num_seqs": max(settings.timing_concurrency)} if device == "cuda" else {}
    if generation_cuda_graphs(vllm_settings, device):
        timing_kwargs["enforce_eager"] = False

    def timed(run: MeasurementRun) -> bool:
        return settings.time_untrained or run.label != "untrained"

    if numerics == "production":
        both = [
            run.model_copy(update={"engine_overrides": lossless_kwargs | timing_kwargs, "timing_pass": timed(run)})
            for run in labelled
        ]
        groups = [(both, False)]
    else:
        timing = [
            run.model_copy(update={"lossless_pass": False, "engine_overrides": timing_kwargs})
            for run in labelled
            if timed(run)
        ]
        # the lossless engines measure outputs, not speed: eager whatever vllm.enforce_eager says. With CUDA graphs each
        # paid its own torch.compile and graph capture for the batch-invariant kernels (8B shape, H100, 2026-12-06:
        # engine starts of 113.6, 92.7 and 36.4 s, compilation 77.7, 51.3 and 17.9 s of them)
        exact_kwargs = lossless_kwargs | {"enforce_eager": True}
        exact = [run.model_copy(update={"timing_pass": False, "engine_overrides": exact_kwargs}) for run in labelled]
        groups = [(timing, False), (exact, True)]
    # on a GPU a spec-decode engine left its 16 GiB KV cache allocated after vLLM's own cleanup, so the next engine
    # of that process failed vLLM's free-memory check (H200, vLLM 0.26, 2026-12-01): one engine per process there
    isolate = settings.isolate_runs if settings.isolate_runs is not None else device != "cpu"
    return [
        PlannedProcess(runs=[run] if isolate else runs, batch_invariant=invariant)
        for runs, invariant in groups
        for run in (runs if isolate else runs[:1])
    ]


def concurrent_processes(settings: EvaluationSettings, vllm_settings: VllmSettings, device: str) -> bool:
    """Whether the measurement processes start all at once: evaluate.concurrent_processes, or (null) on CUDA with
    one GPU per engine and a fixed KV cache. Without a fixed KV cache vLLM sizes it by profiling, and its profiling
    fails ("Error in memory profiling") when another process frees GPU memory meanwhile, as a sibling that ends
    does; tensor-parallel engines at once on the same GPUs were never tried. CPU: one process (plan_measurements)."""
    if settings.concurrent_processes is not None:
        return settings.concurrent_processes
    fixed_kv = bool(settings.kv_cache_memory_bytes or vllm_settings.kv_cache_memory_bytes)
    return device == "cuda" and settings.tensor_parallel_size == 1 and fixed_kv


def engine_memory(
    engine: dict[str, Any],
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    *,
    device: str,
    processes: int,
) -> dict[str, Any]:
    """The engine's kwargs with evaluation's own KV cache (evaluate.kv_cache_memory_bytes, else the vllm section's)
    and, for `processes` > 1 engines at once on a GPU, each one's share of its memory.

    vLLM refuses to start an engine unless the GPU's free memory is at least gpu_memory_utilization x its total,
    even with a fixed KV cache (then the fraction is only that check: vLLM 0.26 took 0.92 when none was given, and
    the third engine of one process failed it on the H200 with 122 of 140 GiB free). So N engines at once each get
    vllm.gpu_memory_utilization / N: with the fraction u <= 1, an engine that starts after N-1 others, each holding
    M bytes, passes when total - (N-1) x M >= u/N x total. Without a fixed KV cache M is u/N x total (vLLM fills its
    share), so that always holds. SmolLM2-135M on one H200 (config/presets/smollm2-135m-gpu.yaml): u = 0.85, N = 6,
    so each engine needs 0.1416 x 139.8 = 19.8 GiB free at its start, and holds M ~ 7 GiB (4 GiB KV cache, weights
    0.3 GiB, activations, CUDA graphs, CUDA context): the last one to start finds >= 139.8 - 5 x 7 = 105 GiB free.
    The 4 GiB cache holds the lossless pass's 164 prompts x ~700 tokens x 23 KB (30 layers x 3 KV heads x 64 x 2 x
    bf16) = 2.6 GB at once; the timing passes hold at most 8 sequences."""
    kwargs = dict(engine)
    if settings.kv_cache_memory_bytes:
        kwargs.pop("gpu_memory_utilization", None)
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    if device != "cpu" and processes > 1:
        kwargs["gpu_memory_utilization"] = math.floor(vllm_settings.gpu_memory_utilization / processes * 1e4) / 1e4
    return kwargs


def check_eagle3_draft(draft: Path) -> None:
    model_type = load(DraftConfig, draft / "config.json").speculators_model_type
    if model_type != "eagle3":
        raise StageError(
            f"{draft}/config.json has speculators_model_type {model_type!r}; "
            "this stage evaluates EAGLE-3 drafts ('eagle3')"
        )


def measure_evaluation(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str],
    first: FirstProcess | None,
    reference: str,
) -> Measured:
    """The planned processes (measure_runs) and, with the untrained draft as the lossless reference, its run of
    each prompt where the trained draft changed the output (measure_untrained_reference)."""
    measured = measure_runs(plan, engine, evaluation, log_path=log_path, env=env, first=first, reference=reference)
    if reference == "untrained":
        measure_untrained_reference(measured, plan, engine, evaluation, log_path=log_path, env=env)
    return measured


def measure_runs(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str] | None = None,
    first: FirstProcess | None = None,
    reference: str = NO_SPECULATION,
    first_index: int = 0,
) -> Measured:
    """Run the planned processes: one after another, or all at once (evaluation.concurrent) with a lock file that
    keeps each timing pass alone. An engine whose result a cut run left in work_dir/runs with the same key
    (everything that decides its result) is reused, not measured again. `env`: the processes' environment
    (plan_environment, taken when the stage started; None: taken now). `first`: the first planned process, started
    early (start_first_process); it gets its spec if it is still the first to run, and is stopped otherwise.
    `first_index`: the number of the plan's first process (measure_<i>), for a plan that follows another."""
    settings, vllm_settings, stop = evaluation.settings, evaluation.vllm_settings, evaluation.stop
    device, work_dir = evaluation.device, evaluation.work_dir
    measured = Measured(lossless={}, timing={}, processes=[])
    spec_fields = dict(prompts=[p.token_ids for p in evaluation.prompt_set.prompts], max_tokens=settings.max_tokens,
                       timing_repeats=settings.timing_repeats, stop_token_ids=stop.token_ids, stop=stop.strings,
                       timing_concurrency=list(settings.timing_concurrency), timing_prompts=settings.timing_prompts)  # fmt: skip
    fingerprints: dict[Path, dict[str, str]] = {}  # each model folder hashed once (a 135M target: ~0.5 s a time)
    pending: list[tuple[int, PlannedProcess, list[MeasurementRun]]] = []
    for i, process in enumerate(plan, start=first_index):
        keyed = [keyed_run(run, engine, spec_fields, batch_invariant=process.batch_invariant, work_dir=work_dir,
                           fingerprints=fingerprints) for run in process.runs]  # fmt: skip
        todo = []
        for run in keyed:
            earlier = reusable_result(run)
            if earlier is None:
                todo.append(run)
            else:
                log.info("reusing %s (measured by an earlier attempt, same key %s)", run.result_path, run.key[:12])
                record(measured, run, earlier)
        if todo:
            pending.append((i, process, todo))
    if not pending:
        return measured
    env = env if env is not None else plan_environment(plan, engine, settings, vllm_settings, device,
                                                       reference=reference)  # fmt: skip
    together = evaluation.concurrent and len(pending) > 1
    measured.concurrent = together
    launches = []
    for i, process, todo in pending:
        spec = MeasurementSpec(engine=engine, runs=todo, batch_invariant=process.batch_invariant,
                               lock_path=str(work_dir / "measure.lock") if together else None,
                               log_prefix=process_log_prefix(todo, i) if together else LOG_PREFIX,
                               **spec_fields)  # fmt: skip
        launches.append(Launch(spec=spec, name=f"measure_{i}", env=env))
    watch = dict(log_path=log_path, timeout_s=settings.timeout_s, stall_timeout_s=vllm_settings.stall_timeout_s)
    started = first.take(launches[0]) if first is not None and not together else None
    if together:
        finished = run_measurement_processes(launches, work_dir, **watch)
    else:
        finished = [run_measurement_process(launch.spec, work_dir, launch.name, env=launch.env, **watch,
                                            started=started if i == 0 else None)
                    for i, launch in enumerate(launches)]  # fmt: skip
    for launch, (result, wall_s) in zip(launches, finished, strict=True):
        measured.vllm_version = result.vllm_version
        for run, run_result in zip(launch.spec.runs, result.runs, strict=True):
            record(measured, run, run_result)
        measured.processes.append(
            MeasurementProcess(
                runs=[f"{r.label} ({r.numerics})" for r in result.runs],
                wall_s=round(wall_s, 2),
                vllm_import_s=round(result.import_s, 2),
                engine_start_s={r.label: round(r.engine_start_s, 2) for r in result.runs},
                load_1m=round(os.getloadavg()[0], 2),
                lock_wait_s={mode: round(s, 2) for mode, s in result.lock_wait_s.items()},
            )
        )
    return measured


def plan_environment(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    device: str,
    *,
    reference: str = NO_SPECULATION,
) -> dict[str, str]:
    """The environment of every measurement process of the plan: eager (runtime.child_environment) when every engine
    the plan starts has enforce_eager, whether or not an earlier attempt's results spare some of them. With a
    speculative reference on CPU, vLLM's CPU attention does not split a request's KV cache across threads
    (VLLM_CPU_ATTN_SPLIT_KV=0): a split is planned from the step's sequence length, which acceptance decides, so a
    verified row's reduction order could differ between two runs that reach the same position by other steps;
    unsplit, each query reduces its context block by block from position 0, whatever step it is in."""
    eager = all_eager(engine, [run for process in plan for run in process.runs])
    env = measurement_environment(device=device, cpu_threads=vllm_settings.cpu_threads,
                                  in_process=settings.tensor_parallel_size == 1, eager=eager)  # fmt: skip
    if device == "cpu" and reference != NO_SPECULATION:
        env["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    # TP > 1 on CPU: a worker per core list (refused, with the fix, when the CPUs cannot give one)
    return env | cpu_engine_environment(device, settings.tensor_parallel_size, vllm_settings.cpu_threads)


@dataclasses.dataclass
class FirstProcess:
    """The first planned measurement process, started before its spec (start_first_process): its name, the kernels
    it imported vLLM with and its environment without them, and the started worker (a context manager)."""

    name: str
    batch_invariant: bool
    env: dict[str, str]
    worker: StartedWorker

    def take(self, launch: Launch) -> StartedWorker | None:
        """The started worker, to run `launch` with, if `launch` is the process it was started as: same name (the
        first in the plan, not reused away by an earlier attempt's results), same kernels, same environment. Else
        None, and the worker is stopped now: the processes that run instead must not share the machine with it."""
        if (launch.name, launch.spec.batch_invariant, launch.env) == (self.name, self.batch_invariant, self.env):
            return self.worker
        changed = sorted(k for k in self.env.keys() | launch.env.keys() if self.env.get(k) != launch.env.get(k))
        log.info("%s, started early, is not the process to run first (%s; batch_invariant %s, environment "
                 "variables changed: %s): stopped", self.name, launch.name, launch.spec.batch_invariant,
                 changed or "none")  # fmt: skip
        self.worker.stop()
        return None

    def __enter__(self) -> FirstProcess:
        self.worker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.worker.finished:
            log.info("%s, started early, got no spec (every run's result reused, or the stage failed first): stopped",
                     self.name)  # fmt: skip
        self.worker.__exit__(*exc)


def start_first_process(
    plan: list[PlannedProcess],
    env: dict[str, str],
    *,
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    work_dir: Path,
    log_path: str | Path | None,
) -> FirstProcess:
    """The first process of a one-after-another plan, to start before the stage loads the tokenizer and prompts and
    builds the untrained draft: it imports vLLM meanwhile (~3 s of a CPU run's measurement process, on the core the
    stage leaves idle), then waits for its spec (measure_runs gives it). Its environment is `env`, the one every
    process of the plan gets (plan_environment), with the kernels of the plan's first process."""
    from eagle3_workflow.evaluation.launch import kernels_environment, start_measurement_process

    process = plan[0]
    worker = start_measurement_process([run.label for run in process.runs], work_dir, "measure_0",
                                       env=kernels_environment(env, batch_invariant=process.batch_invariant),
                                       log_path=log_path, timeout_s=settings.timeout_s,
                                       stall_timeout_s=vllm_settings.stall_timeout_s)  # fmt: skip
    return FirstProcess(name="measure_0", batch_invariant=process.batch_invariant, env=env, worker=worker)


def all_eager(engine: dict[str, Any], runs: list[MeasurementRun]) -> bool:
    """Whether every engine of these runs has enforce_eager (the engine's kwargs with each run's overrides)."""
    return all((engine | run.engine_overrides)["enforce_eager"] for run in runs)


def run_role(run: MeasurementRun) -> str:
    """What a run's engine does: lossless, timing or both (its result file is <label>.<role>.json)."""
    return "lossless" if not run.timing_pass else "timing" if not run.lossless_pass else "both"


def process_log_prefix(runs: list[MeasurementRun], index: int) -> str:
    """The log prefix of a process that runs beside others: its engine (trained.timing), or its number."""
    return log_prefix(f"{runs[0].label}.{run_role(runs[0])}" if len(runs) == 1 else f"measure_{index}")


def keyed_run(
    run: MeasurementRun,
    engine: dict[str, Any],
    spec_fields: dict[str, Any],
    *,
    batch_invariant: bool,
    work_dir: Path,
    fingerprints: dict[Path, dict[str, str]] | None = None,
) -> MeasurementRun:
    """The run with its key (a hash of the engine, the passes, the prompts and the bytes of the models it loads)
    and the file its result goes to. `fingerprints` keeps each model folder's fingerprint for the next call (the
    folders must not change meanwhile)."""
    role = run_role(run)
    fingerprints = {} if fingerprints is None else fingerprints
    models = [engine["model"]] + ([run.speculative_config["model"]] if run.speculative_config else [])
    content = {
        "engine": engine,
        "run": run.model_dump(mode="json", exclude={"key", "result_path"}),
        # the prompts by digest: the key's parts are kept beside the result, and 164 prompts are ~250 KB
        "spec": spec_fields | {"prompts": hashlib.sha256(json.dumps(spec_fields.get("prompts")).encode()).hexdigest()},
        "batch_invariant": batch_invariant,
        "models": {m: known_fingerprint(Path(m), fingerprints) for m in models if Path(m).is_dir()},
        # vLLM's switches and the test fault plugins change results without changing a setting
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "EAGLE3_FAULT"))},
    }
    text = json.dumps(content, sort_keys=True, default=str, indent=1)
    key = hashlib.sha256(text.encode()).hexdigest()
    result_path = work_dir.resolve() / "runs" / f"{run.label}.{role}.json"
    explain_changed_key(result_path.with_suffix(".key.json"), json.loads(text))
    return run.model_copy(update={"key": key, "result_path": str(result_path)})


def explain_changed_key(path: Path, content: dict[str, Any]) -> None:
    """Keep what the key was made of beside the result; when it changed since the last attempt, log which part
    did (the engine is measured again)."""
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = {}
        changed = sorted(k for k in content.keys() | earlier.keys() if content.get(k) != earlier.get(k))
        if changed:
            log.info("%s: measured again, what decides its result changed since the last attempt: %s",
                     path.name.removesuffix(".key.json"), ", ".join(changed))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, sort_keys=True, indent=1))


def known_fingerprint(folder: Path, known: dict[Path, dict[str, str]]) -> dict[str, str]:
    if folder not in known:
        known[folder] = model_fingerprint(folder)
    return known[folder]


def reusable_result(run: MeasurementRun) -> RunResult | None:
    """The result an earlier attempt left for this run, if it was measured with the same key."""
    from eagle3_workflow.artefacts import ArtefactError

    path = Path(run.result_path or "")
    if not path.is_file():
        return None
    try:
        earlier = load(RunResult, path)
    except ArtefactError as exc:
        log.info("not reusing %s: %r", path, exc)
        return None
    return earlier if earlier.key == run.key else None


def record(measured: Measured, run: MeasurementRun, result: RunResult) -> None:
    if run.lossless_pass:
        measured.lossless[run.label] = result
    if run.timing_pass:
        measured.timing[run.label] = result


# the untrained draft's lossless pass on the prompts where the trained draft's output differs from the run without
# speculation, beyond the first evaluate.untrained_prompts (measure_untrained_reference)
UNTRAINED_DIVERGENT = "untrained_divergent"


def prompt_outputs(run: RunResult) -> dict[int, tuple[list[int], list[dict[int, float]]]]:
    """A lossless pass's output and top-k logits by prompt index (RunResult.prompt_indices; None: every prompt)."""
    indices = run.prompt_indices if run.prompt_indices is not None else range(len(run.outputs))
    return {i: (ids, logits) for i, ids, logits in zip(indices, run.outputs, run.top_logits, strict=True)}


def differing_prompts(lossless: dict[str, RunResult]) -> list[int]:
    """The prompts whose greedy output with the trained draft is not token for token the one without speculation."""
    plain, trained = prompt_outputs(lossless[NO_SPECULATION]), prompt_outputs(lossless["trained"])
    return [i for i in sorted(trained) if trained[i][0] != plain[i][0]]


def untrained_outputs(lossless: dict[str, RunResult]) -> dict[int, tuple[list[int], list[dict[int, float]]]]:
    """The untrained draft's outputs by prompt: its first prompts' pass and, if one ran, the pass on the prompts
    where the trained draft's output differs from the run without speculation."""
    merged = prompt_outputs(lossless["untrained"])
    if UNTRAINED_DIVERGENT in lossless:
        merged |= prompt_outputs(lossless[UNTRAINED_DIVERGENT])
    return merged


def measure_untrained_reference(
    measured: Measured,
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str] | None,
) -> None:
    """With the untrained draft as the lossless reference: generate it, one prompt at a time as the trained draft
    was, on every prompt where the trained draft's greedy output differs from the run without speculation and that
    its first pass (the first evaluate.untrained_prompts) did not cover, in one more measurement process; its result
    goes to measured.lossless[UNTRAINED_DIVERGENT]. Where the trained draft's output equals the one without
    speculation token for token, it is lossless there by definition and no reference is needed: on the README's
    SmolLM2 demo that was every prompt (2026-12-06), and this process does not start."""
    differing = differing_prompts(measured.lossless)
    covered = set(prompt_outputs(measured.lossless["untrained"]))
    missing = [i for i in differing if i not in covered]
    log.info("the trained draft's greedy output differs from the run without speculation on %d of %d prompt(s)%s",
             len(differing), len(evaluation.prompt_set.prompts),
             f" {differing}: the untrained draft generates {missing or 'none'} as their reference (it covered "
             f"{sorted(covered)} already)" if differing else ": no reference needed")  # fmt: skip
    if not missing:
        return
    index, untrained = next((i, run) for i, process in enumerate(plan) for run in process.runs
                            if run.label == "untrained" and run.lossless_pass)  # fmt: skip
    run = untrained.model_copy(update={"label": UNTRAINED_DIVERGENT, "lossless_prompts": missing,
                                       "timing_pass": False, "lossless_pass": True})  # fmt: skip
    process = PlannedProcess(runs=[run], batch_invariant=plan[index].batch_invariant)
    extra = measure_runs([process], engine, evaluation, log_path=log_path, env=env, reference="untrained",
                         first_index=len(plan))  # fmt: skip
    measured.lossless |= extra.lossless
    measured.processes += extra.processes
    measured.vllm_version = measured.vllm_version or extra.vllm_version


@dataclasses.dataclass
class LosslessVerdict:
    """Each draft's first divergences from the reference, and every token a run emitted that is not its own
    argmax (the reference's own such tokens under the label no_speculation)."""

    mismatches: dict[str, list[LosslessMismatch]]
    non_argmax: dict[str, list[str]]
    criterion: str
    numerics: str  # the kernels of the lossless pass: batch_invariant | production
    logit_dtype: str  # the dtype whose steps measure a tie
    reference: str = NO_SPECULATION  # the run each judged draft is compared with: untrained | no_speculation
    # each label's smallest gap (dtype steps) of an emitted token below its step's argmax: the argmax check's margin
    non_argmax_min_gap: dict[str, float | None] = dataclasses.field(default_factory=dict)
    # with the untrained reference: each draft's first divergences from the run without speculation (not judged)
    against_no_speculation: dict[str, list[LosslessMismatch]] = dataclasses.field(default_factory=dict)
    # with no reference (none): the trained draft's first divergences from the untrained draft's run (not judged)
    against_untrained: list[LosslessMismatch] = dataclasses.field(default_factory=list)

    def judged(self) -> dict[str, list[LosslessMismatch]]:
        """The drafts compared with the reference (not the reference itself)."""
        return {label: ms for label, ms in self.mismatches.items() if label != self.reference}


def lossless_verdict(
    lossless: dict[str, RunResult],
    prompt_set: PromptSet,
    *,
    logit_dtype: str,
    tie_steps: int,
    numerics: str,
    decode: Callable[[Sequence[int]], str],
    reference: str = NO_SPECULATION,
) -> LosslessVerdict:
    """The lossless pass judged: every run's emitted tokens against its own argmax, and the trained draft's greedy
    output against the reference's (`reference`: untrained, exactly; no_speculation, with `tie_steps`; with the
    run without speculation as the reference the untrained draft is judged against it too).

    With the untrained reference, a prompt passes when the trained draft's output equals the one without
    speculation token for token (lossless by definition: nothing to excuse), or else equals the untrained draft's
    run on that prompt (the same verifier numerics: measure_untrained_reference generated it); each draft's
    divergences from the run without speculation are recorded. The untrained draft's pass covers only its first
    evaluate.untrained_prompts and those prompts, so its own comparisons cover those."""
    origins = [p.origin for p in prompt_set.prompts]
    by_prompt = {label: prompt_outputs(run) for label, run in lossless.items() if label != UNTRAINED_DIVERGENT}
    if "untrained" in lossless:
        by_prompt["untrained"] = untrained_outputs(lossless)

    def against(base: str, label: str, ties: int, prompts: Sequence[int] | None = None) -> list[LosslessMismatch]:
        """`label`'s first divergences from `base` on `prompts` (None: every prompt both runs generated)."""
        shared = sorted(by_prompt[base].keys() & by_prompt[label].keys()) if prompts is None else list(prompts)
        found = compare_greedy(([by_prompt[base][i][0] for i in shared], [by_prompt[base][i][1] for i in shared]),
                               ([by_prompt[label][i][0] for i in shared], [by_prompt[label][i][1] for i in shared]),
                               origins=[origins[i] for i in shared], dtype=logit_dtype, tie_steps=ties,
                               decode=decode)  # fmt: skip
        return [m.model_copy(update={"prompt_index": shared[m.prompt_index]}) for m in found]

    recorded_untrained: list[LosslessMismatch] = []
    if reference == "none":
        mismatches = {"trained": [], "untrained": []}
        report_only = {label: against(NO_SPECULATION, label, 0) for label in DRAFTS}
        recorded_untrained = against("untrained", "trained", 0)
        criterion = (
            "every emitted token of every run is its own argmax; the trained draft's divergences from the untrained "
            "draft's run (both one prompt at a time) and from the run without speculation are recorded, not judged "
            "(evaluate.lossless_reference: none)"
        )
    elif reference == "untrained":
        report_only = {label: against(NO_SPECULATION, label, 0) for label in DRAFTS}
        differing = [m.prompt_index for m in report_only["trained"]]
        unreferenced = [i for i in differing if i not in by_prompt["untrained"]]
        if unreferenced:
            raise StageError(f"the untrained draft's run lacks prompt(s) {unreferenced}, where the trained draft's "
                             "output differs from the run without speculation (a bug: measure_untrained_reference "
                             "generates them)")  # fmt: skip
        mismatches = {"trained": against("untrained", "trained", 0, differing), "untrained": []}
        criterion = (
            "exact: every prompt's greedy output with the trained draft equals the output without speculation, or "
            "where it does not, the untrained draft's on that prompt, both speculative runs generated one prompt at a "
            "time (the same 1 + k verified rows at every step); every emitted token of every run is its own argmax"
        )
    else:
        mismatches = {label: against(NO_SPECULATION, label, tie_steps) for label in DRAFTS}
        report_only = {}
        if tie_steps == 0:
            criterion = "exact: every prompt's speculative greedy output equals the output without speculation"
        else:
            criterion = (
                f"every emitted token is its run's own argmax, and a first divergence passes only as a tie within "
                f"{tie_steps} {logit_dtype} step(s) at the logits' magnitude in both runs"
            )
    # each run's prompts in full (a prompt it did not generate: no tokens), so that the messages name the prompt
    full = {label: ([runs.get(i, ([], []))[0] for i in range(len(origins))],
                    [runs.get(i, ([], []))[1] for i in range(len(origins))])
            for label, runs in by_prompt.items()}  # fmt: skip
    non_argmax = {label: non_argmax_steps(*run, logit_dtype) for label, run in full.items()}
    min_gap = {
        label: min((gap[-1] for gap in non_argmax_gaps(*run, logit_dtype)), default=None) for label, run in full.items()
    }
    return LosslessVerdict(mismatches=mismatches, non_argmax=non_argmax, criterion=criterion, numerics=numerics,
                           logit_dtype=logit_dtype, reference=reference, non_argmax_min_gap=min_gap,
                           against_no_speculation=report_only, against_untrained=recorded_untrained)  # fmt: skip


def draft_results(
    measured: Measured,
    verdict: LosslessVerdict,
    draft_paths: dict[str, Path],
    num_speculative_tokens: int,
) -> dict[str, AcceptanceResult]:
    """Each draft's acceptance, speed-up over the reference and lossless verdict (with the argmax check's margin
    and, under the untrained reference, its divergences from the run without speculation)."""
    results = {
        label: acceptance_result(
            measured.lossless[label],
            measured.timing.get(label),  # None: not timed (evaluate.time_untrained false)
            draft_path=Path(path),
            num_speculative_tokens=num_speculative_tokens,
            reference_timing=measured.timing[NO_SPECULATION],
            mismatches=verdict.mismatches[label],
            non_argmax=verdict.non_argmax[label] + verdict.non_argmax[NO_SPECULATION],
        )
        for label, path in draft_paths.items()
    }
    for label, result in results.items():
        gaps = [g for g in (verdict.non_argmax_min_gap.get(label), verdict.non_argmax_min_gap.get(NO_SPECULATION))
                if g is not None]  # fmt: skip
        results[label] = result.model_copy(update={
            "non_argmax_min_gap_steps": round(min(gaps), 3) if gaps else None,
            "no_speculation_divergences": verdict.against_no_speculation.get(label, []),
            "untrained_divergences": verdict.against_untrained if label == "trained" else [],
            "acceptance_prompts": measured.lossless[label].prompt_indices,
            "reference_prompts": (measured.lossless[UNTRAINED_DIVERGENT].prompt_indices or []
                                  if label == "untrained" and UNTRAINED_DIVERGENT in measured.lossless else []),
        })  # fmt: skip
    return results


def build_report(
    results: dict[str, AcceptanceResult],
    verdict: LosslessVerdict,
    measured: Measured,
    evaluation: Evaluation,
    *,
    untrained_baseline: str,
    notes: list[str],
) -> AcceptanceReport:
    """eval/acceptance.json from the measured runs."""
    settings, prompt_set, stop = evaluation.settings, evaluation.prompt_set, evaluation.stop
    reference = measured.lossless[NO_SPECULATION]
    reference_throughput = throughput(measured.timing[NO_SPECULATION], None)
    return AcceptanceReport(
        num_prompts=len(prompt_set.prompts),
        prompt_source=prompt_set.source,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_tokens=settings.max_tokens,
        trained=results["trained"],
        untrained=results["untrained"],
        no_speculation_tokens_per_s=reference_throughput[0].tokens_per_s if reference_throughput else 0.0,
        no_speculation_throughput=reference_throughput,
        lossless=all(r.lossless for r in results.values()),
        lossless_mismatches=sum(len(ms) for ms in verdict.judged().values()),
        lossless_reference=verdict.reference,
        num_prompts_requested=prompt_set.requested,
        prompt_detail=prompt_set.detail,
        device=evaluation.device,
        vllm_version=measured.vllm_version,
        no_speculation_generated_tokens=reference.generated_tokens,
        no_speculation_generate_s=reference.generate_s,
        no_speculation_engine_start_s=measured.timing[NO_SPECULATION].engine_start_s,
        lossless_numerics=verdict.numerics,
        logit_dtype=verdict.logit_dtype,
        lossless_tie_steps=settings.lossless_tie_steps,
        lossless_criterion=verdict.criterion,
        untrained_baseline=untrained_baseline,
        processes=measured.processes,
        notes=notes,
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )


def report_notes(
    results: dict[str, AcceptanceResult], verdict: LosslessVerdict, measured: Measured, evaluation: Evaluation
) -> list[str]:
    """What a reader of the numbers must know: ties, a draft that does not beat its baseline, why speculation
    does not pay at batch 1, CPU timing, server flags that an offline engine does not take."""
    settings, device, vllm_settings = evaluation.settings, evaluation.device, evaluation.vllm_settings
    notes = []
    ties = sum(m.tie for ms in verdict.mismatches.values() for m in ms)
    if ties:
        notes.append(f"{ties} first divergence(s) passed as ties within {settings.lossless_tie_steps} dtype step(s)")
    total = len(evaluation.prompt_set.prompts)
    if verdict.reference == "untrained":
        differing = [m.prompt_index for m in verdict.against_no_speculation["trained"]]
        untrained = results["untrained"]
        counted = untrained.acceptance_prompts or []
        notes.append(
            f"lossless reference: the run without speculation, token for token; where the trained draft's output "
            f"differs from it ({len(differing)}/{total} prompts{f': {differing}' if differing else ''}), the "
            "untrained draft's run on that prompt, token for token, both speculative lossless passes one prompt at a "
            "time (the same 1 + k verified rows at every step: docs/faults.md, 'The lossless verdict'). The untrained "
            f"draft generated its first {len(counted)} prompt(s) (its acceptance counts these; "
            f"{len(verdict.against_no_speculation['untrained'])} of them differ from the run without speculation) "
            + (
                f"and prompts {untrained.reference_prompts} as the reference"
                if untrained.reference_prompts
                else "and no other: none needed it as the reference"
            )  # fmt: skip
        )
    elif verdict.reference != NO_SPECULATION:
        recorded = {label: len(ms) for label, ms in verdict.against_no_speculation.items()}
        what = (f"none: the argmax check alone ({len(verdict.against_untrained)}/{total} prompts differ from the "
                "untrained draft's run, in trained.untrained_divergences)")  # fmt: skip
        notes.append(
            f"lossless reference: {what}; both speculative lossless passes ran one prompt at a time (the same 1 + k "
            "verified rows at every step); against the run without speculation (one row a step) "
            + ", ".join(f"{n}/{total} prompts differ with the {label} draft" for label, n in recorded.items())
            + " (<draft>.no_speculation_divergences, recorded, not judged: docs/faults.md, 'The lossless verdict')"
        )
    if results["trained"].mean_acceptance_length <= results["untrained"].mean_acceptance_length:
        notes.append(
            f"the trained draft does not beat the untrained baseline (mean acceptance length "
            f"{results['trained'].mean_acceptance_length:.3f} vs {results['untrained'].mean_acceptance_length:.3f})"
        )
    notes += step_time_notes(results["trained"], throughput(measured.timing[NO_SPECULATION], None))
    untimed = [label for label, result in results.items() if not result.throughput]
    if untimed:
        notes.append(
            f"not timed (evaluate.time_untrained false): {', '.join(untimed)}; acceptance and the lossless verdict "
            "are measured all the same, tokens/s and speedup are not (0 in this file)"
        )
    if measured.concurrent:
        notes.append(
            "the measurement processes ran at once; each timing pass (its warm-up and measured passes) held the "
            "evaluation's lock alone, so no other process imported vLLM, started an engine or generated meanwhile "
            "(each process's waits for the lock: processes[].lock_wait_s)"
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


def step_time_notes(trained: AcceptanceResult, reference: list[Throughput]) -> list[str]:
    """At concurrency 1: speculation pays when acceptance length x target step time > verification step time."""
    spec = next((t for t in trained.throughput if t.concurrency == 1), None)
    plain = next((t for t in reference if t.concurrency == 1), None)
    if spec is None or plain is None or not spec.ms_per_step or not plain.ms_per_step:
        return []
    tokens_per_step = spec.generated_tokens / (spec.seconds * 1000 / spec.ms_per_step)
    return [
        f"at concurrency 1: a target step takes {plain.ms_per_step:.2f} ms without speculation; a speculative step "
        f"(the draft proposes {len(trained.per_position_acceptance)} tokens, then one verification) "
        f"takes {spec.ms_per_step:.2f} ms ({spec.ms_per_step / plain.ms_per_step:.2f}x) and yields "
        f"{tokens_per_step:.2f} tokens, so speculation pays when that ratio is below the tokens per step"
    ]


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
