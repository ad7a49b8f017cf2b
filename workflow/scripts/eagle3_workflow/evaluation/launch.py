"""The stage's side of a measurement process: the offline engine's keyword arguments, the child's environment,
and one ``python -m eagle3_workflow.evaluation.measure --spec spec.json --result result.json`` run as a
runtime.worker (several at once: run_measurement_processes). vLLM never runs in the stage process: ``vllm.LLM``
spawns processes that re-import ``__main__``, and under Snakemake's script directive ``__main__`` is the stage
script."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_workflow.evaluation.protocol import LOG_PREFIX, MeasurementResult, MeasurementSpec
from eagle3_workflow.serving.engine import offline_engine_kwargs
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import VllmSettings

if TYPE_CHECKING:
    from eagle3_workflow.runtime.worker import Job, StartedWorker

log = logging.getLogger("eagle3.evaluation")

TAIL_LINES = 60
MEASURE_MODULE = "eagle3_workflow.evaluation.measure"
STOP_WAIT_S = 60.0  # how long the stage waits for the threads of stopped processes (SIGTERM, grace, kill: ~10 s)


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
                                   seed=seed, tensor_parallel_size=tensor_parallel_size, device=device,
                                   tensor_parallel_setting="evaluate.tensor_parallel_size")  # fmt: skip
    kwargs["disable_log_stats"] = False  # vllm.LLM turns stats off by default, and with them get_metrics()
    kwargs["enable_prefix_caching"] = False  # every engine does the same work on the same prompts
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def measurement_environment(
    *, device: str, cpu_threads: int | None, in_process: bool, eager: bool = False
) -> dict[str, str]:
    """The child's environment: vLLM's engine in-process (or not), as the engine kwargs say; `eager` when every
    engine it starts has enforce_eager (runtime.child_environment). Which kernels it runs is the spec's
    (MeasurementSpec.batch_invariant): the process sets that switch itself."""
    from eagle3_workflow.runtime import child_environment

    env = child_environment(vllm_on_cpu=device == "cpu", cpu_threads=cpu_threads, eager=eager)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def kernels_environment(env: dict[str, str], *, batch_invariant: bool) -> dict[str, str]:
    """The environment of a measurement process started before its spec: the kernels the stage planned for it, which
    measure.prepare imports vLLM with (a process given its spec at the start sets them itself, measure.use_kernels)."""
    env = dict(env)
    if batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    else:
        env.pop("VLLM_BATCH_INVARIANT", None)
    return env


def measurement_job(
    labels: list[str],
    *,
    env: dict[str, str],
    log_path: str | Path | None,
    prefix: str,
    timeout_s: float,
    stall_timeout_s: float | None = None,
    check: Callable[[], None] | None = None,
) -> Job:
    """The runtime.worker Job of the measurement process of these runs: stopped past `timeout_s`, or when requests
    are in flight and none finishes for `stall_timeout_s` (or longer, when the observed pace is slower:
    runtime.worker.Watch), or when `check` raises (what it raised is raised)."""
    from eagle3_workflow.runtime.worker import Job, Watch

    return Job(
        name=f"the measurement process ({', '.join(labels)})",
        env=env,
        watch=Watch(timeout_s=timeout_s, timeout_setting="evaluate.timeout_s", stall_timeout_s=stall_timeout_s),
        log_path=log_path,
        prefix=prefix,
        tail_lines=TAIL_LINES,
        check=check,
    )


def start_measurement_process(
    labels: list[str], work_dir: Path, name: str, *, env: dict[str, str], log_path: str | Path | None, **watch: Any
) -> StartedWorker:
    """A measurement process started now, before its spec (runtime.worker.start_worker): it imports vLLM while the
    stage loads the tokenizer and prompts and builds the untrained draft; run_measurement_process(..., started=)
    gives it the spec. `env` must name its kernels (kernels_environment). Use as a context manager."""
    from eagle3_workflow.runtime.worker import WorkerFiles, start_worker

    job = measurement_job(labels, env=env, log_path=log_path, prefix=LOG_PREFIX, **watch)
    return start_worker(MEASURE_MODULE, files=WorkerFiles.in_folder(work_dir, name), job=job)


def run_measurement_process(
    spec: MeasurementSpec,
    work_dir: Path,
    name: str,
    *,
    env: dict[str, str],
    log_path: str | Path | None,
    timeout_s: float,
    stall_timeout_s: float | None = None,
    check: Callable[[], None] | None = None,
    started: StartedWorker | None = None,
) -> tuple[MeasurementResult, float]:
    """Run one measurement process (<work_dir>/<name>.spec.json in, <name>.result.json back); its output goes into
    the log after the spec's log prefix. Returns the result and the wall time. `started`: the process of that name,
    started before its spec (start_measurement_process), which gets the spec instead of a new process. The watch:
    measurement_job."""
    from eagle3_workflow.runtime.worker import WorkerFiles, run_worker

    if started is not None:
        finished = started.finish(spec, MeasurementResult)
    else:
        job = measurement_job([r.label for r in spec.runs], env=env, log_path=log_path, prefix=spec.log_prefix,
                              timeout_s=timeout_s, stall_timeout_s=stall_timeout_s, check=check)  # fmt: skip
        files = WorkerFiles.in_folder(work_dir, name)
        finished = run_worker(MEASURE_MODULE, spec, MeasurementResult, files=files, job=job)
    log.info("measurement process %s done in %.1f s", name, finished.wall_s)
    return finished.result, finished.wall_s


@dataclasses.dataclass(frozen=True)
class Launch:
    """One of the measurement processes that run at once: its spec, name (<name>.spec.json) and environment."""

    spec: MeasurementSpec
    name: str
    env: dict[str, str]


class StoppedForAnother(StageError):
    """A measurement process stopped because another one failed (or the stage is being stopped)."""


def run_measurement_processes(
    launches: list[Launch],
    work_dir: Path,
    *,
    log_path: str | Path | None,
    timeout_s: float,
    stall_timeout_s: float | None = None,
) -> list[tuple[MeasurementResult, float]]:
    """Run the processes all at once, each started and watched by a thread of its own (run_measurement_process:
    its time limit and stall watch as when it runs alone). Returns each one's result and wall time, in order.

    The first process to fail stops the others (SIGTERM, a short grace, then their trees killed), and its failure is
    raised, naming the processes it stopped; what a stopped one had measured is already in its runs' result files.
    A stop of the stage itself (SIGTERM: StageStopped in this thread) stops them all, then is raised."""
    stop = threading.Event()
    finished: dict[int, tuple[MeasurementResult, float]] = {}
    failures: list[tuple[int, BaseException]] = []  # in the order they happened
    guard = threading.Lock()

    def stop_if_another_failed() -> None:
        if stop.is_set():
            raise StoppedForAnother("stopped: another measurement process failed, or the stage is being stopped")

    def run(index: int, launch: Launch) -> None:
        try:
            finished[index] = run_measurement_process(launch.spec, work_dir, launch.name, env=launch.env,
                                                      log_path=log_path, timeout_s=timeout_s,
                                                      stall_timeout_s=stall_timeout_s,
                                                      check=stop_if_another_failed)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - raised by the stage's thread below
            with guard:
                failures.append((index, exc))
            stop.set()

    threads = [threading.Thread(target=run, args=(i, launch), name=f"measure-{launch.name}", daemon=True)
               for i, launch in enumerate(launches)]  # fmt: skip
    log.info("%d measurement processes at once: %s", len(launches), ", ".join(launch.name for launch in launches))
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)
    except BaseException:
        stop.set()
        for thread in threads:
            thread.join(timeout=STOP_WAIT_S)
        raise
    if failures:
        raise first_failure(failures, [launch.name for launch in launches])
    return [finished[i] for i in range(len(launches))]


def first_failure(failures: list[tuple[int, BaseException]], names: list[str]) -> BaseException:
    """The failure to raise: the first that did not come from being stopped, with the names of those it stopped
    (their own failures are only that they were stopped)."""
    cause_index, cause = next(((i, e) for i, e in failures if not isinstance(e, StoppedForAnother)), failures[0])
    stopped = [
        names[i] for i, e in sorted(failures, key=lambda failure: failure[0]) if isinstance(e, StoppedForAnother)
    ]
    if not stopped or not isinstance(cause, StageError):
        return cause
    error = StageError(f"{cause}\n(the measurement processes ran at once: {', '.join(stopped)} stopped because "
                       f"{names[cause_index]} failed)")  # fmt: skip
    error.__cause__ = cause
    return error
