"""Every process a stage starts (vLLM server, offline engine, trainer) runs through ChildProcess.

One way to start, watch and stop a child, so every stage gets the same guarantees:
- the child runs under ``launcher.py`` in its own session: the whole tree (vLLM's EngineCore and workers,
  torchrun's ranks, DataLoader workers) dies with the stage, even on SIGKILL (see launcher.py for how);
- each output line goes into the rule's log with a prefix; the first lines (start-up errors) and the last ones
  (a failure after hours) are kept for the failure message, which quotes the first traceback to its exception;
- an optional wall-clock limit and an optional progress watch: an engine that stops finishing work while it
  still runs (a SIGSTOPped or wedged EngineCore, a hung collective) fails the stage instead of looking busy;
- stop() sends SIGTERM to the command (through the launcher), waits a short grace, then kills the whole tree;
  a tree that already ended, or a child that failed (timeout, stall), is not waited for.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.runtime")

LAUNCHER = Path(__file__).resolve().with_name("launcher.py")
ERROR_LINES_KEPT = 400

# Lines an engine child prints so that the parent can tell work from a hang (see ProgressWatch); a worker prints
# them through runtime.worker (report_busy, report_idle, engine_progress_bar)
MARKER_PREFIX = "@@eagle3 "
BUSY_MARKER = "@@eagle3 busy"  # requests are in flight from now on: the watch is armed
PROGRESS_MARKER = "@@eagle3 progress"  # one request (or batch) finished
IDLE_MARKER = "@@eagle3 idle"  # no request in flight (an engine is loading): the watch is off

# Prefixes vLLM and torchrun put before a line, outermost first; stripped (repeatedly) before a line is read
# as part of a traceback. Worker: "(EngineCore_DP0 pid=123) ", "(Worker_TP0 pid=7) ", "(APIServer pid=1) ".
# Logger: "ERROR 12-01 04:38:56 [core.py:123] " (vLLM repeats it on every line of a multi-line message),
# also with milliseconds or without the date. torchrun: "[rank0]: ".
_PREFIXES = re.compile(
    r"^(?:\([A-Za-z_][\w.-]*(?: pid=\d+)?\)\s"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?:\d{2}-\d{2}\s+\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s+)?\[[^\]]*\]\s?"
    r"|\[rank\d+\]:\s?)"
)
_TRACEBACK_PARTS = ("Traceback", "File ", "During handling", "The above exception")


def strip_log_prefixes(line: str) -> str:
    line = line.rstrip("\r\n")
    while True:
        stripped = _PREFIXES.sub("", line, count=1)
        if stripped == line:
            return line
        line = stripped


_PROCESS_TAG = re.compile(r"^\(([A-Za-z_][\w.-]*(?: pid=\d+)?)\)\s")


def process_tag(line: str) -> str | None:
    """The process a vLLM line came from: "Worker_TP1 pid=7" for "(Worker_TP1 pid=7) ERROR ...", else None."""
    found = _PROCESS_TAG.match(line)
    return found.group(1) if found else None


def traceback_indices(lines: Sequence[str]) -> list[int]:
    """The indices of the first Python traceback's lines, from its header through its exception line ([] if none).

    A traceback's lines are those of the process that printed its header: vLLM's processes (API server, engine
    core, each TP worker) share one output, so another process's lines can fall between them and are skipped.
    """
    return _first_traceback(lines)[0]


def _first_traceback(lines: Sequence[str]) -> tuple[list[int], bool]:
    """traceback_indices, and whether the traceback reached its exception line (not cut off by the end of lines)."""
    texts = [strip_log_prefixes(line) for line in lines]
    for start, text in enumerate(texts):
        if not text.lstrip().startswith("Traceback (most recent call last)"):
            continue
        tag = process_tag(lines[start])
        indent = len(text) - len(text.lstrip())
        kept = [start]
        for end in range(start + 1, len(texts)):
            if process_tag(lines[end]) != tag:
                continue
            kept.append(end)
            body = texts[end]
            if (
                body.strip()
                and len(body) - len(body.lstrip()) <= indent
                and not body.lstrip().startswith(_TRACEBACK_PARTS)
            ):
                return kept, True
        return kept, False
    return [], False


def traceback_span(lines: Sequence[str]) -> tuple[int, int] | None:
    """[start, end) of the first Python traceback, from its header through its exception line."""
    kept = traceback_indices(lines)
    return (kept[0], kept[-1] + 1) if kept else None


def first_traceback(lines: Sequence[str]) -> str:
    """The first traceback in lines, prefixes stripped, ending with its exception line ("" if none)."""
    return "\n".join(strip_log_prefixes(lines[i]) for i in traceback_indices(lines))


def exception_summary(lines: Sequence[str]) -> str:
    """One line that names the first traceback's exception, the frame that raised it and the process:
    'AttributeError (its message is empty), raised at File "m.py", line 3, in embed (process Worker_TP1 pid=7)'.

    The exception line alone can say nothing: an exception whose message is empty prints only its type (and
    vLLM's engine then reports "Worker failed with error ''"), so the raising frame is what points at the bug.
    "" without a traceback."""
    kept = traceback_indices(lines)
    if not kept:
        return ""
    texts = [strip_log_prefixes(lines[i]).strip() for i in kept]
    last = texts[-1]
    frames = [text for text in texts if text.startswith('File "')]
    if len(texts) == 1 or last.startswith(_TRACEBACK_PARTS):
        said = "a traceback cut short before its exception line"
    elif last.endswith(":") or ":" not in last:
        said = f"{last.rstrip(':')} (its message is empty)"
    else:
        said = last
    where = f", raised at {frames[-1]}" if frames else ""
    tag = process_tag(lines[kept[0]])
    return f"{said}{where}" + (f" (process {tag})" if tag else "")


def stall_limit_s(floor_s: float, factor: float, slowest_s: float) -> float:
    """How long a watch waits for the next finished item: the floor, or `factor` times the slowest seen so far when
    that is longer (every stall watch of the workflow: engines, extraction's client, the online trainer)."""
    return max(floor_s, factor * slowest_s)


@dataclasses.dataclass
class ProgressWatch:
    """When requests are in flight, a finished one must be seen at least every `limit_s()` seconds.

    The limit adapts to the observed pace: `factor` times the slowest interval between finished items so far,
    never below `floor_s` (the config key `setting`), which also bounds the wait for the first item.
    """

    floor_s: float
    factor: float = 20.0
    setting: str = "vllm.stall_timeout_s"  # the key that sets floor_s, named in the stall message
    slowest_interval_s: float = 0.0
    armed: bool = False
    last_s: float = 0.0  # monotonic time of the last busy or progress marker

    def limit_s(self) -> float:
        return stall_limit_s(self.floor_s, self.factor, self.slowest_interval_s)

    def observe(self, line: str, now: float) -> None:
        if line.startswith(PROGRESS_MARKER):
            if self.armed:
                self.slowest_interval_s = max(self.slowest_interval_s, now - self.last_s)
            self.armed, self.last_s = True, now
        elif line.startswith(BUSY_MARKER):
            self.armed, self.last_s = True, now
        elif line.startswith(IDLE_MARKER):
            self.armed = False

    def stalled_for(self, now: float) -> float | None:
        """Seconds without progress, when that exceeds the limit; else None."""
        quiet = now - self.last_s
        return quiet if self.armed and quiet > self.limit_s() else None


class ChildFailure(StageError):
    """A child ran past its limit or stopped making progress; the message quotes its output."""


class ChildProcess:
    """One child process and its tree. Use as a context manager (start; stop on the way out), then wait()."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        prefix: str = "",
        on_line: Callable[[str], None] | None = None,
        clean: Callable[[str], str] | None = None,
        timeout_s: float | None = None,
        timeout_hint: str = "",
        progress: ProgressWatch | None = None,
        head_lines: int = 200,
        tail_lines: int = 60,
        stop_grace_s: float = 5.0,
        output_label: str = "lines of its output",
        watch: Callable[[], None] | None = None,
    ):
        self.command, self.name, self.env = list(command), name, env
        self.log_path = Path(log_path) if log_path else None
        self.prefix, self.on_line, self.clean = prefix, on_line, clean
        self.timeout_s, self.timeout_hint, self.progress = timeout_s, timeout_hint, progress
        self.stop_grace_s, self.output_label = stop_grace_s, output_label
        self.watch = watch  # called with every check (twice a second while waiting): raises to end the child
        self.head: list[str] = []
        self.head_lines = head_lines
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.error_lines: list[str] = []
        self.line_count = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.started_s = 0.0
        self._watch_fd: int | None = None
        self._reader: threading.Thread | None = None
        self._sink: TextIO | None = None  # the rule's log, while it can be written

    # ------------------------------------------------------------------ start and read

    def start(self) -> ChildProcess:
        read_fd, self._watch_fd = os.pipe()
        # -E -S: the launcher is stdlib only; no PYTHONPATH, site-packages or sitecustomize (a test's fault
        # plugin, say) is loaded into it. The command still gets the environment unchanged.
        argv = [sys.executable, "-E", "-S", str(LAUNCHER), str(read_fd), "--", *self.command]
        try:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own group: stop() signals the whole tree, never the stage
                pass_fds=(read_fd,),
            )
        finally:
            os.close(read_fd)
        self.started_s = time.monotonic()
        if self.progress is not None:
            self.progress.last_s = self.started_s
        self._reader = threading.Thread(target=self._read_output, name=f"{self.name}-output", daemon=True)
        self._reader.start()
        return self

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        # a child that ran past its limit or hangs gets no grace: it would not use it
        self.stop(grace_s=0.0 if exc_type is not None and issubclass(exc_type, ChildFailure) else None)

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        try:
            self._sink = open(self.log_path, "a", encoding="utf-8") if self.log_path else None  # noqa: SIM115
        except OSError as exc:
            self._log_unwritable(exc)
        try:
            for raw in self.process.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._take(self.clean(line) if self.clean else line)
        finally:
            self._close_sink()

    def _take(self, line: str) -> None:
        if line.startswith(MARKER_PREFIX):  # for the watch only: one per request would drown the log
            if self.progress is not None:
                self.progress.observe(line, time.monotonic())
            return
        self._write_to_log(line)
        self.line_count += 1
        if len(self.head) < self.head_lines:
            self.head.append(line)
        else:
            self.tail.append(line)
        if len(self.error_lines) < ERROR_LINES_KEPT and (self.error_lines or "Traceback" in line or "Error" in line):
            self.error_lines.append(line)
        if self.on_line is not None:
            self.on_line(line)

    def _write_to_log(self, line: str) -> None:
        """Append to the rule's log. A log that cannot be written (a full disk) is given up, said once: the output
        is still read (a child blocked on a full pipe would look hung), watched and kept for a failure message."""
        if self._sink is None:
            return
        try:
            self._sink.write(f"{self.prefix}{line}\n")
            self._sink.flush()
        except OSError as exc:
            self._log_unwritable(exc)
            self._close_sink()

    def _log_unwritable(self, exc: OSError) -> None:
        log.warning(
            "cannot write the output of %s to %s (%r); it is still watched, and its last lines go into any failure "
            "message",
            self.name,
            self.log_path,
            exc,
        )

    def _close_sink(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            try:
                sink.close()
            except OSError:  # the flush of what a full disk refused: said already
                pass

    # ------------------------------------------------------------------ state

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def output(self) -> list[str]:
        """The kept lines: the head, a count of those left out, the tail."""
        omitted = self.line_count - len(self.head) - len(self.tail)
        gap = [f"... ({omitted} lines omitted) ..."] if omitted > 0 else []
        return self.head + gap + list(self.tail)

    def last_lines(self, count: int | None = None) -> list[str]:
        lines = (self.head + list(self.tail))[-(count or self.tail.maxlen or 60) :]
        return lines

    def failure_text(self, headline: str, *, where: str | None = None) -> str:
        """The headline, the first exception in one line (type, raising frame, process), the first traceback (to
        its exception line), and the child's last lines."""
        self.drain()
        self._settle_traceback()
        source = self.error_lines if traceback_span(self.error_lines) else self.output()
        quoted = first_traceback(source)
        tail = self.last_lines()
        parts = [headline]
        if quoted:
            parts.append(f"first exception: {exception_summary(source)}")
            parts.append(f"first traceback in the output of {self.name}:\n{quoted}")
        parts.append(f"last {len(tail)} {self.output_label} ({where or self.log_path or 'above'}):")
        parts.append("\n".join(tail))
        return "\n".join(parts)

    def _settle_traceback(self, timeout_s: float = 2.0) -> None:
        """Give the reader up to `timeout_s` for the rest of a traceback whose header it has taken: a failure seen
        at the header (a fatal line, a watch twice a second) would otherwise quote a traceback without its
        exception line. A child that stays silent costs the wait once; one that exited is drained already."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._reader is not None and self._reader.is_alive():
            kept, complete = _first_traceback(self.error_lines)
            if not kept or complete:
                return
            time.sleep(0.05)

    def check(self) -> None:
        """Raise ChildFailure if the child ran past its time limit or stopped making progress, or what `watch`
        raises (a process the child depends on died, say)."""
        if self.watch is not None:
            self.watch()
        now = time.monotonic()
        if self.timeout_s is not None and now - self.started_s > self.timeout_s:
            raise ChildFailure(
                self.failure_text(f"{self.name} ran past its limit of {self.timeout_s:.0f} s {self.timeout_hint}")
            )
        quiet = self.progress.stalled_for(now) if self.progress is not None else None
        if quiet is not None and self.poll() is None:
            raise ChildFailure(
                self.failure_text(
                    f"{self.name}: no progress for {quiet:.0f} s; engine alive but not answering (limit "
                    f"{self.progress.limit_s():.0f} s: {self.progress.setting}, or {self.progress.factor:g} times "
                    "the slowest interval between finished requests so far). A wedged GPU, a hung collective or "
                    "a stopped engine process looks like this."
                )
            )

    def wait(self) -> int:
        """Wait for the child to exit (checking the limits); its exit status, negative for a signal."""
        assert self.process is not None, "not started"
        while True:
            try:
                code = self.process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                self.check()
        self.drain()
        return code

    def drain(self, timeout_s: float = 5.0) -> None:
        """Let the reader take the last lines of an exited child."""
        if self._reader is not None and self.poll() is not None:
            # the launcher is gone: anything left in its group (the launcher itself was killed, so nothing
            # cleaned up after the command) is an orphan that would hold the output pipe open
            self._signal_group(signal.SIGKILL)
            self._reader.join(timeout=timeout_s)

    # ------------------------------------------------------------------ stop

    def _signal_group(self, signum: int) -> bool:
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _continue_tree(self) -> None:
        """SIGCONT to the launcher's group and to every process below it: torchrun starts its ranks in sessions of
        their own, out of the group's reach."""
        from eagle3_workflow.runtime.launcher import descendants

        self._signal_group(signal.SIGCONT)
        for pid in descendants(self.pid):
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                continue

    def _end_watch(self) -> None:
        """Close the stage's end of the launcher's pipe: a live launcher then kills its whole tree at once."""
        if self._watch_fd is not None:
            os.close(self._watch_fd)
            self._watch_fd = None

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM to the command, a short grace, then the whole tree killed. Safe to call twice."""
        process = self.process
        if process is None:
            return
        grace = self.stop_grace_s if grace_s is None else grace_s
        if process.poll() is None and grace > 0:
            process.send_signal(signal.SIGTERM)  # the launcher passes it to the command, which stops its children
            self._continue_tree()  # a stopped (SIGSTOP) process acts on SIGTERM only once resumed
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGTERM: killing its process tree", self.name, grace)
        self._end_watch()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            process.wait(timeout=10)
        self._signal_group(signal.SIGKILL)  # anything left in the group (normally nothing)
        if process.stdout is not None and self._reader is not None:
            self._reader.join(timeout=5)
