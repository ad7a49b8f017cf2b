"""The one way a stage hands work to a child process and gets its answer back: spec in, typed result out.

Parent side (the stage):
- ``run_command(command, job)``: any command (the report's nested ``snakemake --report``) as a ChildProcess, so it
  dies with the stage even on SIGKILL; its lines go into the rule's log; a wall-clock limit and the progress watch
  come from ``job.watch``; a non-zero exit is a StageError quoting the first traceback and the last lines.
- ``run_worker(module, spec, result_type, files=..., job=...)``: ``python -m <module> --spec S --result R`` through
  run_command, the spec (an artefacts.Artefact) written to S first; the result read back from R as `result_type`.

Worker side (the child's ``if __name__ == "__main__":``):
- ``serve(spec_type, work, name=...)``: reads the spec, runs `work(spec)`, writes the result it returns atomically.
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

from eagle3_workflow.artefacts import Artefact, load, write
from eagle3_workflow.errors import StageError
from eagle3_workflow.runtime.child import (
    BUSY_MARKER,
    IDLE_MARKER,
    PROGRESS_MARKER,
    ChildProcess,
    ProgressWatch,
)

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
        code = child.wait()
    if code != 0:
        raise job.failure(child, f"{job.name} exited with code {code}")
    return child, time.perf_counter() - started


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


def worker_command(module: str, files: WorkerFiles) -> list[str]:
    return [sys.executable, "-m", module, "--spec", str(files.spec), "--result", str(files.result)]


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
    if not files.result.is_file():
        raise job.failure(child, f"{job.name} exited with code 0 but wrote no result {files.result}; this is a bug")
    return Finished(result=load(result_type, files.result), wall_s=wall_s)


# ---------------------------------------------------------------------------------------------------- worker side


def serve(spec_type: type[S], work: Callable[[S], Artefact], *, name: str, argv: Sequence[str] | None = None) -> None:
    """The worker's ``__main__``: ``--spec S --result R``; read S as `spec_type`, write what `work` returns to R.

    Exits 0 after writing the result; 1 on any failure, printing its repr and whole traceback for the parent to
    quote (a StageError too: the traceback ends in its message); 128 + signal after a stop signal."""
    from eagle3_workflow.runtime.stage import StageStopped, describe_exception, install_stop_handlers, setup_logging

    parser = argparse.ArgumentParser(description=f"{name}: a worker of a stage (runtime.worker)")
    parser.add_argument("--spec", required=True, type=Path, help=f"{spec_type.__name__} JSON")
    parser.add_argument("--result", required=True, type=Path, help="where to write the result JSON")
    args = parser.parse_args(argv)
    setup_logging(None)
    install_stop_handlers()
    try:
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
