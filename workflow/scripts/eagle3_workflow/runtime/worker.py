"""The one way a stage hands work to a child process and gets its answer back: spec in, typed result out.

Parent side (the stage):
- ``run_command(command, job)``: any command (the report's nested ``snakemake --report``) as a ChildProcess, so it
  dies with the stage even on SIGKILL; its lines go into the rule's log; a wall-clock limit and the progress watch
  come from ``job.watch``; a non-zero exit is a StageError quoting the first traceback and the last lines.
- ``run_worker(module, spec, result_type, files=..., job=...)``: ``python -m <module> --spec S --result R`` through
  run_command, the spec (a files.artefacts.Artefact) written to S first; the result read back from R as `result_type`.
- ``start_worker(module, files=..., job=...)``: the same process started before its spec is known (``--await-spec``):
  it runs its ``prepare`` (imports vLLM, say) while the stage still builds the spec, then waits for S;
  ``finish(spec, result_type)`` writes S and waits as run_worker does. Left unfinished, it is stopped.

Worker side (the child's ``if __name__ == "__main__":``):
- ``serve(spec_type, work, name=..., prepare=...)``: reads the spec, runs `work(spec)`, writes the result it returns
  atomically; started with ``--await-spec``, it runs `prepare()` first and waits for the spec file to appear.
  A failure prints the exception and its whole traceback (the parent quotes it) and exits 1; SIGTERM is one line
  and exit 143, as in a stage (runtime.stage's signal policy).
- ``report_busy`` / ``report_idle`` / ``engine_progress_bar``: progress for the parent's watch. A worker with
  requests in flight says busy, and each finished request (vLLM's progress bar) is a marker line; an engine that
  stops finishing requests while it still runs fails the stage as stalled, after
  max(``watch.stall_timeout_s``, ``watch.stall_factor`` x the slowest interval so far). Idle (an engine loading)
  is bounded by ``watch.timeout_s`` only.

A spec or result class must not be defined in the worker's own module: run with ``-m`` that module is ``__main__``,
and vLLM's spawned processes re-import ``__main__``. Each stage keeps its models in a ``protocol`` module.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from eagle3_workflow.files.artefacts import Artefact, load, write
from eagle3_workflow.runtime.child import (
    BUSY_MARKER,
    IDLE_MARKER,
    PROGRESS_MARKER,
    ChildProcess,
    ProgressWatch,
)
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.runtime")

S = TypeVar("S", bound=Artefact)
R = TypeVar("R", bound=Artefact)

STALL_FACTOR = ProgressWatch.factor  # 20: the limit in slowest intervals so far


# ---------------------------------------------------------------------------------------------------- parent side


@dataclasses.dataclass(frozen=True)
class Watch:
    """How a child is watched; the same keys for every child.

    timeout_s: wall-clock limit (None: none), named in the message by `timeout_setting` (the config key that sets
    it). stall_timeout_s: with requests in flight a finished one must be seen at least every
    max(stall_timeout_s, stall_factor x the slowest interval between finished ones so far); None: no stall watch;
    named in the message by `stall_setting`.
    """

    timeout_s: float | None = None
    timeout_setting: str = ""
    stall_timeout_s: float | None = None
    stall_factor: float = STALL_FACTOR
    stall_setting: str = "vllm.stall_timeout_s"

    def progress(self) -> ProgressWatch | None:
        if not self.stall_timeout_s:
            return None
        return ProgressWatch(floor_s=self.stall_timeout_s, factor=self.stall_factor, setting=self.stall_setting)

    def timeout_hint(self) -> str:
        return f"({self.timeout_setting}) and was stopped" if self.timeout_setting else "and was stopped"


@dataclasses.dataclass(frozen=True)
class Job:
    """One child as the stage sees it: its name in messages, environment, watch, and where its lines go.

    Each line goes into `log_path` after `prefix` (a line the child printed with the prefix itself gets it once)
    and/or to `on_line`. `failure_hint` follows the failure message: what usually causes such a failure. `check` is
    called twice a second while the child runs: what it raises stops the child (SIGTERM, a short grace, then its
    tree killed) and is raised (a stage running several children at once stops the others when one fails)."""

    name: str
    env: dict[str, str] | None = None
    watch: Watch = Watch()
    log_path: str | Path | None = None
    prefix: str = ""
    on_line: Callable[[str], None] | None = None
    tail_lines: int = 60
    failure_hint: str = ""
    check: Callable[[], None] | None = None

    def child(self, command: Sequence[str]) -> ChildProcess:
        prefix = self.prefix
        return ChildProcess(
            command,
            name=self.name,
            env=self.env,
            log_path=self.log_path,
            prefix=prefix,
            on_line=self.on_line,
            clean=(lambda line: line.removeprefix(prefix)) if prefix else None,
            timeout_s=self.watch.timeout_s,
            timeout_hint=self.watch.timeout_hint(),
            progress=self.watch.progress(),
            tail_lines=self.tail_lines,
            watch=self.check,
        )

    def failure(self, child: ChildProcess, headline: str) -> StageError:
        text = child.failure_text(headline)
        return StageError(f"{text}\n{self.failure_hint}" if self.failure_hint else text)


def run_command(command: Sequence[str], job: Job) -> float:
    """Run `command` as a ChildProcess under `job`; its wall time in seconds. A non-zero exit, a run past the time
    limit or a stall is a StageError quoting the command's first traceback and last lines."""
    return _run(command, job)[1]


def _run(command: Sequence[str], job: Job) -> tuple[ChildProcess, float]:
    started = time.perf_counter()
    child = job.child(command)
    with child:
        _wait_ok(child, job)
    return child, time.perf_counter() - started


def _wait_ok(child: ChildProcess, job: Job) -> None:
    code = child.wait()
    if code != 0:
        raise job.failure(child, f"{job.name} exited with code {code}")


@dataclasses.dataclass(frozen=True)
class WorkerFiles:
    """Where a worker's spec and result go."""

    spec: Path
    result: Path

    @classmethod
    def in_folder(cls, folder: Path, stem: str) -> WorkerFiles:
        return cls(spec=folder / f"{stem}.spec.json", result=folder / f"{stem}.result.json")


@dataclasses.dataclass(frozen=True)
class Finished(Generic[R]):
    result: R
    wall_s: float


AWAIT_SPEC = "--await-spec"
SPEC_POLL_S = 0.02  # how often a worker started early looks for its spec file


def worker_command(module: str, files: WorkerFiles, *, await_spec: bool = False) -> list[str]:
    return [sys.executable, "-m", module, "--spec", str(files.spec), "--result", str(files.result),
            *([AWAIT_SPEC] if await_spec else [])]  # fmt: skip


def _read_result(child: ChildProcess, files: WorkerFiles, result_type: type[R], job: Job) -> R:
    if not files.result.is_file():
        raise job.failure(child, f"{job.name} exited with code 0 but wrote no result {files.result}; this is a bug")
    return load(result_type, files.result)


def run_worker(module: str, spec: Artefact, result_type: type[R], *, files: WorkerFiles, job: Job) -> Finished[R]:
    """Write `spec`, run ``python -m <module>`` (whose ``__main__`` calls `serve`) under `job`, read its result.

    A result left by an earlier attempt is removed first, so the one read is this run's."""
    files.spec.parent.mkdir(parents=True, exist_ok=True)
    files.result.parent.mkdir(parents=True, exist_ok=True)
    write(files.spec, spec)
    files.result.unlink(missing_ok=True)
    command = worker_command(module, files)
    log.info("%s: %s", job.name, " ".join(command))
    child, wall_s = _run(command, job)
    return Finished(result=_read_result(child, files, result_type, job), wall_s=wall_s)


class StartedWorker:
    """A worker started before its spec exists (start_worker): it prepares (serve's `prepare`) while the stage builds
    the spec, then waits for the spec file. Use as a context manager: leaving it without `finish` (the stage failed,
    or found nothing left for the worker to do) stops the worker and its tree."""

    def __init__(self, module: str, files: WorkerFiles, job: Job):
        self.module, self.files, self.job = module, files, job
        self.child = job.child(worker_command(module, files, await_spec=True))
        self.started = 0.0
        self.finished = False

    def __enter__(self) -> StartedWorker:
        self.files.spec.parent.mkdir(parents=True, exist_ok=True)
        self.files.result.parent.mkdir(parents=True, exist_ok=True)
        self.files.spec.unlink(missing_ok=True)  # an earlier attempt's spec must not start this one
        self.files.result.unlink(missing_ok=True)
        log.info("%s, started before its spec: %s", self.job.name, " ".join(self.child.command))
        self.started = time.perf_counter()
        self.child.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if not self.finished:
            self.stop(exc_type)

    def stop(self, exc_type: type[BaseException] | None = None) -> None:
        """Stop a worker that will get no spec (SIGTERM, a short grace, then its tree killed). Safe to call twice."""
        self.finished = True
        self.child.__exit__(exc_type)

    def finish(self, spec: Artefact, result_type: type[R]) -> Finished[R]:
        """Give the worker its spec (written atomically: the worker never reads half of it) and wait for its result,
        as run_worker does. wall_s counts from the start, the wait for the spec included."""
        try:
            write(self.files.spec, spec)
            _wait_ok(self.child, self.job)  # one that died while preparing fails here, quoting its traceback
        finally:
            self.finished = True
            self.child.__exit__(sys.exc_info()[0])
        return Finished(result=_read_result(self.child, self.files, result_type, self.job),
                        wall_s=time.perf_counter() - self.started)  # fmt: skip


def start_worker(module: str, *, files: WorkerFiles, job: Job) -> StartedWorker:
    """``python -m <module> --spec S --result R --await-spec`` under `job`, started now, its spec given later
    (StartedWorker.finish). The watch's limits count from now."""
    return StartedWorker(module, files, job)


# ---------------------------------------------------------------------------------------------------- worker side


def serve(
    spec_type: type[S],
    work: Callable[[S], Artefact],
    *,
    name: str,
    prepare: Callable[[], None] | None = None,
    argv: Sequence[str] | None = None,
) -> None:
    """The worker's ``__main__``: ``--spec S --result R``; read S as `spec_type`, write what `work` returns to R.
    With ``--await-spec`` (start_worker): run `prepare()`, then wait for S to appear (the parent writes it atomically;
    the parent's watch bounds the wait, and the worker dies with the parent).

    Exits 0 after writing the result; 1 on any failure, printing its repr and whole traceback for the parent to
    quote (a StageError too: the traceback ends in its message); 128 + signal after a stop signal."""
    from eagle3_workflow.runtime.stage import StageStopped, describe_exception, install_stop_handlers, setup_logging

    parser = argparse.ArgumentParser(description=f"{name}: a worker of a stage (runtime.worker)")
    parser.add_argument("--spec", required=True, type=Path, help=f"{spec_type.__name__} JSON")
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    parser.add_argument(AWAIT_SPEC, action="store_true", help="prepare, then wait for the spec file to appear")
    args = parser.parse_args(argv)
    setup_logging(None)
    install_stop_handlers()
    try:
        if args.await_spec:
            if prepare is not None:
                prepare()
            while not args.spec.exists():
                time.sleep(SPEC_POLL_S)
        write(args.result, work(load(spec_type, args.spec)))
    except StageStopped as stop:
        print(f"{name} stopped by {stop.signal_name}", file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    except BaseException as exc:  # noqa: BLE001 - the parent quotes this from the log
        print(f"{name} FAILED: {describe_exception(exc)}", file=sys.stderr, flush=True)
        sys.exit(1)


def print_marker(marker: str) -> None:
    """One marker line for the parent's watch (BUSY/PROGRESS/IDLE_MARKER), flushed."""
    print(marker, flush=True)


def report_busy() -> None:
    """Requests are in flight from now on: each must finish within the stall limit (the watch is armed)."""
    print_marker(BUSY_MARKER)


def report_idle() -> None:
    """No request in flight (an engine is loading): only the wall-clock limit applies."""
    print_marker(IDLE_MARKER)


def report_progress() -> None:
    """One request (or batch) finished."""
    print_marker(PROGRESS_MARKER)


def engine_progress_bar() -> type:
    """A tqdm class for vllm.LLM.generate(use_tqdm=...): reports progress per finished request.

    vLLM calls `update(n)` on the bar as requests finish, from the loop that drives the engine, so a marker
    means the engine answered (a heartbeat thread would keep ticking while the engine hangs). The bar itself
    is drawn nowhere: its carriage-return output is useless in a log.
    """
    from tqdm import tqdm

    class MarkerBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["file"] = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the bar
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if n:
                report_progress()
            return super().update(n)

    return MarkerBar
