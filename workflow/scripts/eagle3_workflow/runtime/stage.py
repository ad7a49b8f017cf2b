"""How every stage runs: logging to the rule's log, one failure format, one signal policy.

Signal policy (the whole package): SIGTERM or SIGINT to a stage process (Snakemake cancelling the job, SLURM
preemption or time limit, scancel, Ctrl-C) raises StageStopped in the main thread. Children started through
ChildProcess are stopped on the way out (their context managers), the stage logs one line saying so and what the
rerun will do, and exits 128 + the signal number (143 for SIGTERM). Declared outputs are written last, so the rerun
resumes. A stage whose rerun depends on what it left on disk (training: which checkpoint) passes a function that
reads the disk once its children are stopped, so the line states what the rerun will actually do.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from eagle3_workflow.settings.errors import StageError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StageStopped(SystemExit):  # noqa: N818 - not an error: a request to stop, like KeyboardInterrupt
    """The stage process received a stop signal. A SystemExit (exit code 128 + signum), so `except Exception`
    cannot swallow it, and neither can asyncio: its event loop and transports re-raise SystemExit and
    KeyboardInterrupt from callbacks but log any other BaseException raised there and carry on (a SIGTERM that
    landed in a socket write of the extraction client was once logged as "Fatal write error" and the stage ran
    to completion)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def describe_exception(exc: BaseException) -> str:
    """repr() plus the full traceback: never the bare `str(e)`, which can be empty."""
    return f"{exc!r}\n{''.join(traceback.format_exception(exc))}"


class LogFileHandler(logging.FileHandler):
    """The rule's log file. When it cannot be written (a full disk), it says so once on stderr and writes no more:
    logging's default prints a "--- Logging error ---" traceback per record, which buried the stage's own message
    (stderr, the Snakemake or SLURM output, still gets every record)."""

    unwritable = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.unwritable:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.unwritable = True
        sys.stderr.write(
            f"cannot write the log file {self.baseFilename} ({error!r}); the rest of the log goes to stderr only\n"
        )
        try:
            self.close()
        except OSError:  # the flush of what the disk refused
            pass


def setup_logging(log_path: str | Path | None = None) -> logging.Logger:
    """Log to stderr and, when given, to the rule's log file (both keep everything)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        # the file first: its one line about a full disk then comes before the record on stderr, not after the
        # stage's FAILED block
        handlers.insert(0, LogFileHandler(log_path, mode="a"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    return logging.getLogger("eagle3")


_received: list[int] = []  # stop signals received by this process, whatever became of the exception


def _raise_stopped(signum: int, _frame: object) -> None:
    for other in STOP_SIGNALS:  # a second signal must not interrupt the teardown the first one started
        signal.signal(other, signal.SIG_IGN)
    _received.append(signum)
    raise StageStopped(signum)


def stop_received() -> StageStopped | None:
    """The stop this process was asked for, if a stop signal arrived: also when the StageStopped it raised was
    swallowed on its way up (raised inside a C extension's callback, it can come out as another exception: a
    SIGTERM during a safetensors read surfaced as a ValueError about torch.storage.UntypedStorage)."""
    return StageStopped(_received[0]) if _received else None


def install_stop_handlers() -> None:
    """Make SIGTERM/SIGINT raise StageStopped (main thread only: Python delivers signals there)."""
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _raise_stopped)


def rerun_sentence(resumes: str | Callable[[], str]) -> str:
    """What the rerun does: the fixed sentence, or the one the function works out now. A function that fails
    still gives a line (a stop must never end in a traceback instead of its one line)."""
    if isinstance(resumes, str):
        return resumes
    try:
        return resumes()
    except Exception as exc:  # noqa: BLE001 - the stop line is logged whatever went wrong here
        return f"what the rerun will do could not be worked out ({exc!r})"


def run_stage(
    name: str,
    log_path: str | Path | None,
    body: Callable[[logging.Logger], object],
    *,
    resumes: str | Callable[[], str] = "the rerun resumes",
) -> None:
    """Run a stage body; on failure log the cause (repr + traceback) and exit non-zero.

    Snakemake deletes declared outputs of a failed job, and stages write their artefact last, so a failed
    stage never leaves a file the next stage could mistake for success. `resumes` says what a rerun after a
    stop signal does (the one line logged then): a sentence, or a function called after the body's children
    are stopped that works it out from what is on disk.
    """
    log = setup_logging(log_path)
    log.info("stage %s: start", name)
    install_stop_handlers()
    try:
        body(log)
        stop = stop_received()
        if stop is not None:  # the exception was swallowed on its way up (a library's catch-all): still a stop
            raise stop
    except StageStopped as stop:
        log.warning("stage %s stopped by %s; %s", name, stop.signal_name, rerun_sentence(resumes))
        sys.exit(128 + stop.signum)
    except BaseException as exc:  # noqa: BLE001 - after a stop signal any failure is the teardown's consequence
        stop = stop_received()
        if stop is None:
            _report_failure(log, name, exc)
        # a stop signal arrived, then the body failed (a server stopped for the stop left a half-written file that
        # the client read first): the job was stopped, the rerun resumes; the failure is said, not raised as one
        log.warning("stage %s stopped by %s; %s (the body then ended with %r, a consequence of the stop)",
                    name, stop.signal_name, rerun_sentence(resumes), exc)  # fmt: skip
        sys.exit(128 + stop.signum)
    log.info("stage %s: done", name)


def _report_failure(log: logging.Logger, name: str, exc: BaseException) -> None:
    """The failure's one report and exit 1: a StageError by its message, anything else with its traceback."""
    if isinstance(exc, StageError):
        log.error("stage %s FAILED:\n%s", name, exc)
        log.debug("%s", describe_exception(exc))
        sys.exit(1)
    log.error("stage %s FAILED with an unexpected error:\n%s", name, describe_exception(exc))
    sys.exit(1)
