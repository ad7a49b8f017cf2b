"""The stage's side of a measurement process: the offline engine's keyword arguments, the child's environment,
and one ``python -m eagle3_workflow.evaluation.measure --spec spec.json --result result.json`` run as a
runtime.worker. vLLM never runs in the stage process: ``vllm.LLM`` spawns processes that re-import
``__main__``, and under Snakemake's script directive ``__main__`` is the stage script."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.evaluation.protocol import LOG_PREFIX, MeasurementResult, MeasurementSpec
from eagle3_workflow.settings import VllmSettings
from eagle3_workflow.vllm_server import offline_engine_kwargs

log = logging.getLogger("eagle3.evaluation")

TAIL_LINES = 60


def measurement_engine_kwargs(
    vllm_settings: VllmSettings,
    *,
    target: str,
    dtype: str,
    trust_remote_code: bool,
    seed: int,
    device: str,
    tensor_parallel_size: int,
    in_process: bool,
) -> dict[str, Any]:
    """The offline engine of every measurement (speculation is added per run). A local target is named by its
    absolute path: the spec must mean the same from any working directory (vLLM reads a relative path that does
    not exist there as a hub repo id)."""
    model = str(Path(target).resolve()) if Path(target).exists() else target
    kwargs = offline_engine_kwargs(vllm_settings, model=model, dtype=dtype, trust_remote_code=trust_remote_code,
                                   seed=seed, tensor_parallel_size=tensor_parallel_size, device=device)  # fmt: skip
    kwargs["disable_log_stats"] = False  # vllm.LLM turns stats off by default, and with them get_metrics()
    kwargs["enable_prefix_caching"] = False  # every engine does the same work on the same prompts
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def measurement_environment(*, device: str, cpu_threads: int | None, in_process: bool) -> dict[str, str]:
    """The child's environment: vLLM's engine in-process (or not), as the engine kwargs say. Which kernels it runs
    is the spec's (MeasurementSpec.batch_invariant): the process sets that switch itself."""
    from eagle3_workflow.runtime import child_environment

    env = child_environment(vllm_on_cpu=device == "cpu", cpu_threads=cpu_threads)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def run_measurement_process(
    spec: MeasurementSpec,
    work_dir: Path,
    name: str,
    *,
    env: dict[str, str],
    log_path: str | Path | None,
    timeout_s: float,
    stall_timeout_s: float | None = None,
) -> tuple[MeasurementResult, float]:
    """Run one measurement process (<work_dir>/<name>.spec.json in, <name>.result.json back); its output goes into
    the log. Returns the result and the wall time.

    The process is stopped if it runs past `timeout_s`, or if requests are in flight and none finishes for
    `stall_timeout_s` (or longer, when the observed pace is slower: runtime.worker.Watch)."""
    from eagle3_workflow.runtime.worker import Job, Watch, WorkerFiles, run_worker

    labels = ", ".join(r.label for r in spec.runs)
    job = Job(
        name=f"the measurement process ({labels})",
        env=env,
        watch=Watch(timeout_s=timeout_s, timeout_setting="evaluate.timeout_s", stall_timeout_s=stall_timeout_s),
        log_path=log_path,
        prefix=LOG_PREFIX,
        tail_lines=TAIL_LINES,
    )
    files = WorkerFiles.in_folder(work_dir, name)
    finished = run_worker("eagle3_workflow.evaluation.measure", spec, MeasurementResult, files=files, job=job)
    log.info("measurement process %s done in %.1f s", name, finished.wall_s)
    return finished.result, finished.wall_s
