"""Planning evaluate_draft's measurements: which engines run, in which processes, with which kernels, engine
keyword arguments and environment, and whether the processes start one after another or all at once. Nothing here
starts a process (measurements runs the plan).

Three engines are measured: no speculation (the reference), the trained draft, the untrained draft. With
``evaluate.isolate_runs: null`` (the default) a CPU run does all three in one process with vLLM's engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): an engine then starts in ~3 s instead of
~15-25 s with the engine-core and worker processes (measured on the tiny target, 2 cores), and the vLLM import
(~6 s) is paid once. On GPU each engine gets its own process, so its memory is free before the next one starts;
``tensor_parallel_size > 1`` always uses vLLM's multiprocess engine.

On CUDA with a fixed KV cache (``evaluate.concurrent_processes: null``, concurrent_processes()) those processes
start all at once: their imports and engine starts (torch.compile, CUDA graphs: most of a 135M target's
evaluation) overlap, and a lock file keeps each timing pass alone (gate.Gate). Each engine passes vLLM's
start-up free-memory check beside the others with its share of the GPU (engine_memory()).

The lossless pass's kernels (lossless_numerics) and its reference (lossless_reference) are settled here too: with
the untrained draft as the reference (CPU) the speculative engines' lossless passes generate one prompt at a time
and the untrained draft only its first ``evaluate.untrained_prompts`` prompts (the rest as needed:
measurements.measure_untrained_reference).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from eagle3_workflow.evaluation.launch import measurement_environment
from eagle3_workflow.evaluation.protocol import NO_SPECULATION, MeasurementRun
from eagle3_workflow.serving.engine import cpu_engine_environment, generation_cuda_graphs
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import EvaluationSettings, VllmSettings

log = logging.getLogger("eagle3.evaluation")


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


@dataclasses.dataclass
class PlannedProcess:
    """One measurement process: its engines and whether it runs vLLM's batch-invariant kernels."""

    runs: list[MeasurementRun]
    batch_invariant: bool


@dataclasses.dataclass(frozen=True)
class MeasurementPlan:
    """The stage's plan (plan_evaluation): the processes, the engine's kwargs with each engine's share of the GPU,
    the environment of every process, and whether they start all at once."""

    processes: list[PlannedProcess]
    engine: dict[str, Any]
    env: dict[str, str]
    concurrent: bool


def plan_evaluation(
    labelled: list[MeasurementRun],
    engine: dict[str, Any],
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    *,
    device: str,
    numerics: str,
    reference: str,
) -> MeasurementPlan:
    """The processes that measure the labelled engines (plan_measurements), whether they start at once
    (concurrent_processes), each engine's memory (engine_memory) and the processes' environment (plan_environment)."""
    plan = plan_measurements(labelled, settings=settings, vllm_settings=vllm_settings, device=device, numerics=numerics,
                             reference=reference)  # fmt: skip
    concurrent = concurrent_processes(settings, vllm_settings, device) and len(plan) > 1
    # the share of each engine comes from the plan, not from what a cut attempt left to measure: the engine's
    # kwargs are part of each result's key
    engine = engine_memory(engine, settings, vllm_settings, device=device, processes=len(plan) if concurrent else 1)
    log.info("%d measurement process(es), %s", len(plan),
             "all at once, each timing pass alone (lock file)" if concurrent else "one after another")  # fmt: skip
    # the processes' environment, taken once, now: what runs in the stage's process meanwhile may set variables of
    # its own (torch's inductor sets TORCHINDUCTOR_CACHE_DIR when asked for its cache folder)
    env = plan_environment(plan, engine, settings, vllm_settings, device, reference=reference)
    return MeasurementPlan(processes=plan, engine=engine, env=env, concurrent=concurrent)


def lossless_scope(
    labelled: list[MeasurementRun], settings: EvaluationSettings, reference: str
) -> list[MeasurementRun]:
    """The labelled runs with what their lossless passes generate: with a speculative reference the speculative
    engines one prompt at a time (MeasurementRun.lossless_alone); with the untrained reference the untrained draft
    only its first evaluate.untrained_prompts (its acceptance; the rest as needed)."""
    alone = reference != NO_SPECULATION
    labelled = [
        run.model_copy(update={"lossless_alone": alone and run.speculative_config is not None}) for run in labelled
    ]
    if reference == "untrained":
        first = list(range(settings.untrained_prompts))
        labelled = [run.model_copy(update={"lossless_prompts": first}) if run.label == "untrained" else run
                    for run in labelled]  # fmt: skip
    return labelled


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
    labelled = lossless_scope(labelled, settings, reference)
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


def all_eager(engine: dict[str, Any], runs: list[MeasurementRun]) -> bool:
    """Whether every engine of these runs has enforce_eager (the engine's kwargs with each run's overrides)."""
    return all((engine | run.engine_overrides)["enforce_eager"] for run in runs)
