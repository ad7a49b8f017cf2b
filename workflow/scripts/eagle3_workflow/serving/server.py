"""The vLLM server's whole life, shared by the canary, extraction and online training: start, readiness, log watch,
teardown (how it is configured: engine.py).

A server is bound to 127.0.0.1 on a free port with a random API key. Its output is streamed line by line into
the rule's log and scanned continuously: a fatal signature ("WorkerProc shutting down" while work is pending,
"EngineCore failed", out of memory, a Python traceback) or the process exiting ends the stage at once, quoting
the server's last lines and the first traceback. The process runs as a runtime.ChildProcess: its whole tree
(API server, engine core, workers) is stopped on success, failure and SIGTERM (runtime.stage's policy), and dies
with the stage even when the stage is SIGKILLed, so no orphan holds GPUs. A server that already failed is
stopped without a grace period: its tree is killed at once.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3_workflow.files.disk import disk_full_line
from eagle3_workflow.runtime.child import ChildProcess, strip_log_prefixes
from eagle3_workflow.serving.engine import ServerSpec, build_server_command, server_environment
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.vllm_server")

# (pattern, what it means). Matched against every server output line while work is pending.
FATAL_SIGNATURES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"WorkerProc shutting down"), "a vLLM worker process is shutting down while work is pending"),
    (
        re.compile(r"EngineCore (failed|encountered a fatal error)|Engine core initialization failed"),
        "the vLLM engine core failed",
    ),
    (re.compile(r"EngineDeadError|EngineGenerateError"), "the vLLM engine died"),
    (re.compile(r"(CUDA )?out of memory|OutOfMemoryError", re.IGNORECASE), "out of memory"),
    (re.compile(r"^Traceback \(most recent call last\)"), "a Python traceback in the server"),
    # the connector's writer thread logs this and carries on: the sample's file is missing or cut short
    (re.compile(r"Hidden-states write failed"), "the hidden-states connector could not write a sample's file"),
]
TAIL_LINES = 60


class ServerFailure(StageError):
    """The server died or printed a fatal signature; the message quotes its log."""


class PortTaken(ServerFailure):
    """The port chosen for the server was taken by another process before vLLM bound it (free_port can only say a
    port is free now), or another server answers on it: VLLMServer starts again on a fresh port."""


# vLLM's bind failure (launcher.create_server_socket): another process took the port between free_port() and the bind
ADDRESS_IN_USE = re.compile(r"\[Errno 98\] Address already in use|EADDRINUSE")
PORT_ATTEMPTS = 3
# how often wait_ready asks a starting server: the wait past the moment it is ready averages half of this (0.5 s cost
# ~0.25 s per start); a refused connection or a /health answer costs the server microseconds
READY_POLL_S = 0.1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def match_fatal(line: str) -> str | None:
    text = strip_log_prefixes(line)  # "(EngineCore_DP0 pid=123) ", "ERROR 12-01 04:38:56 [core.py:12] "
    for pattern, meaning in FATAL_SIGNATURES:
        if pattern.search(text):
            return meaning
    return None


class VLLMServer:
    """A running vLLM OpenAI server. Use as a context manager; `check()` raises if it died."""

    STOP_GRACE_S = 10.0  # a healthy server stops in a few seconds; a failed one is not waited for at all

    def __init__(self, spec: ServerSpec, log_path: str | Path, *, python: str = sys.executable):
        self.spec = spec
        self.log_path = Path(log_path)
        self.python = python
        self.api_key = secrets.token_hex(16)
        self.port = 0
        self.child: ChildProcess | None = None
        self.fatal: str | None = None
        self.fatal_line: str = ""
        self.disk_full_line: str | None = None  # the first line that says the disk (or a quota) is full
        self.ready_s: float = 0.0
        self._stopping = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def tail(self) -> list[str]:
        """The server's last output lines."""
        return self.child.last_lines(TAIL_LINES) if self.child is not None else []

    def __enter__(self) -> VLLMServer:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.start()
            try:
                self.wait_ready()
                return self
            except PortTaken as taken:
                self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                log.warning("%s; starting the server again on a fresh port (attempt %d of %d)", taken.args[0].splitlines()[0],
                            attempt + 1, PORT_ATTEMPTS)  # fmt: skip
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.port = free_port()
        self.fatal, self.fatal_line, self.disk_full_line, self._stopping = None, "", None, False
        cmd = build_server_command(self.spec, self.port, self.python)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM: %s", " ".join(cmd))
        log.info("server log: %s", self.log_path)
        self.child = ChildProcess(
            cmd,
            name="the vLLM server",
            env=server_environment(self.spec, self.api_key),
            log_path=self.log_path,
            prefix="[vllm] ",
            on_line=self._watch_line,
            tail_lines=TAIL_LINES,
            stop_grace_s=self.STOP_GRACE_S,
            output_label="server log lines",
        ).start()

    def _watch_line(self, line: str) -> None:
        if self.disk_full_line is None:
            self.disk_full_line = disk_full_line(strip_log_prefixes(line))
        if not self._stopping and self.fatal is None:
            meaning = match_fatal(line)
            if meaning:
                self.fatal, self.fatal_line = meaning, line

    def _failure(self, headline: str) -> ServerFailure:
        assert self.child is not None
        if self.fatal_line:
            headline += f"\nfirst fatal line: {self.fatal_line}"
        return ServerFailure(self.child.failure_text(headline))

    def check(self) -> None:
        """Raise ServerFailure at once if the server exited or printed a fatal signature."""
        if self.child is None:
            raise ServerFailure("the vLLM server was never started")
        code = self.child.poll()
        if code is not None and not self._stopping:
            raise self._failure(f"the vLLM server exited with code {code} while work was pending")
        if self.fatal is not None:
            raise self._failure(f"the vLLM server failed: {self.fatal}")

    def wait_ready(self) -> float:
        """Wait until this server answers /health and, with its own API key, /v1/models. Raises PortTaken when vLLM
        could not bind its port or another server answers there (never talk to someone else's server), ServerFailure
        for any other failure."""
        start = time.monotonic()
        deadline = start + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                self.check()
            except ServerFailure as failure:
                if self._port_in_use():
                    raise PortTaken(
                        f"port {self.port} (or another port the server binds) was taken before vLLM bound it\n{failure}"
                    ) from failure
                raise
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:  # noqa: S310
                    if response.status == 200 and self._answers_with_our_key():
                        self.ready_s = time.monotonic() - start
                        log.info("vLLM ready on 127.0.0.1:%d after %.1f s", self.port, self.ready_s)
                        return self.ready_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(READY_POLL_S)
        raise self._failure(
            f"the vLLM server was not ready after {self.spec.ready_timeout_s:.0f} s "
            "(vllm.ready_timeout_s); a large model may need more, a stuck one shows why below"
        )

    def _port_in_use(self) -> bool:
        return self.child is not None and any(ADDRESS_IN_USE.search(line) for line in self.child.last_lines(TAIL_LINES))

    def _answers_with_our_key(self) -> bool:
        """/v1/models with this server's API key: 200 from our server; 401 means another server owns the port."""
        request = urllib.request.Request(f"{self.base_url}/v1/models", headers=self.headers())
        try:
            with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
                return response.status == 200
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                raise PortTaken(
                    f"another server answers on port {self.port} (HTTP {error.code} to this server's API key)"
                ) from error
            return False

    def stop(self) -> None:
        """Stop the whole process tree. A server that already failed is killed without a grace period
        (a broken engine does not answer SIGTERM: it used to cost 30 s per failed start). Safe to call twice."""
        self._stopping = True
        if self.child is not None:
            self.child.stop(grace_s=0.0 if self.fatal is not None else None)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}
