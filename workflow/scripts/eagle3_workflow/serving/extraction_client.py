"""The hidden-state client: the production extraction path's HTTP side, shared by extract_hidden_states and the canary
(so the gate exercises exactly the code the extraction runs).

An async client sends each sample's token ids to a ready vLLM server (serving.server) as a 1-token completion; the
connector writes ``<req_id>.safetensors`` into the server's storage folder; the client waits for the writer's lock,
checks the header and token ids, and renames the file to ``hs_<row>.safetensors`` (atomic on one filesystem). A
watchdog checks the server twice a second: a dead server ends the call at once (ServerFailure), one alive but not
answering past the stall limit raises ServerStalled. ProgressTracker counts, writes progress.json and a bar line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.files.data_artefacts import ProgressSnapshot
from eagle3_workflow.files.hidden_states import HiddenStateFiles
from eagle3_workflow.files.writing import process_umask
from eagle3_workflow.runtime.child import stall_limit_s
from eagle3_workflow.serving.server import ServerFailure, VLLMServer
from eagle3_workflow.settings.errors import StageError

T = TypeVar("T")

log = logging.getLogger("eagle3.extraction")


class ServerStalled(StageError):
    """The server is alive but no sample finished for the stall limit while requests were in flight."""


@dataclasses.dataclass
class ClientSettings:
    """The client's limits: extraction's from its settings (client_settings), the canary's its own."""

    concurrency: int
    request_timeout_s: float
    max_retries: int
    progress_interval_s: float
    fail_after_samples: int | None
    # a stall: requests in flight and no sample finished for max(floor, factor x slowest sample so far)
    stall_timeout_s: float
    stall_factor: float


@dataclasses.dataclass
class Sample:
    row: int
    input_ids: list[int]


class ProgressTracker:
    """Counts, rates and ETA; writes progress.json atomically and a bar line into the log."""

    def __init__(self, path: Path | None, replica: int, total: int, already_done: int):
        self.path, self.replica, self.total = path, replica, total
        self.done = already_done
        self.done_this_run = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.last_finished = self.started
        self.slowest_sample_s = 0.0
        self.in_flight = 0
        self.state = "starting"
        self.report_period_s = 5.0

    def add(self, tokens: int, latency_s: float = 0.0) -> None:
        self.done += 1
        self.done_this_run += 1
        self.tokens += tokens
        self.last_finished = time.monotonic()
        self.slowest_sample_s = max(self.slowest_sample_s, latency_s)

    def idle_s(self) -> float:
        """Seconds since the last sample finished (or since the client started)."""
        return time.monotonic() - max(self.last_finished, self.started)

    def snapshot(self, message: str = "") -> ProgressSnapshot:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        samples_per_s = self.done_this_run / elapsed
        remaining = self.total - self.done
        eta = remaining / samples_per_s if samples_per_s > 0 else (0.0 if remaining == 0 else None)
        return ProgressSnapshot(
            state=self.state,
            replica=self.replica,
            samples_done=self.done,
            samples_total=self.total,
            tokens_done=self.tokens,
            tokens_per_s=round(self.tokens / elapsed, 1),
            eta_s=None if eta is None else round(eta, 1),
            updated_unix=time.time(),
            message=message,
        )

    def write(self, message: str = "", *, in_place_when_full: bool = False) -> None:
        snap = self.snapshot(message)
        if self.path is not None:
            write(self.path, snap, in_place_when_full=in_place_when_full)
        width = 30
        filled = int(width * snap.samples_done / max(snap.samples_total, 1))
        eta = "?" if snap.eta_s is None else f"{snap.eta_s:.0f}s"
        idle = self.idle_s()
        # a rate and an ETA keep looking plausible while nothing finishes: say so once it lasts
        quiet = (
            f", last sample finished {idle:.0f} s ago"
            if self.state == "running" and idle > 3 * self.report_period_s
            else ""
        )
        log.info(
            "[%s%s] %d/%d samples, %.0f tok/s, ETA %s%s%s",
            "#" * filled,
            "." * (width - filled),
            snap.samples_done,
            snap.samples_total,
            snap.tokens_per_s,
            eta,
            quiet,
            f" ({message})" if message else "",
        )

    def finish(self, state: str, message: str) -> None:
        """The last word in progress.json (done, failed, stalled, stopped) with the samples truly on disk. Never
        raises: a full disk fails this write too, and it must not replace the stage's own error."""
        self.state, self.in_flight = state, 0
        try:
            self.write(message[:500], in_place_when_full=True)
        except OSError as exc:
            log.warning("could not record the state %r in %s (%r)", state, self.path, exc)


# the stop events of the waits in flight: release_waits() ends their threads when the event loop ended before the
# waits' own `finally` ran (a stop signal raised in a task's synchronous part stops the loop at once; each thread
# then polled to its request_timeout_s deadline, and the interpreter joins them at exit: the stage hung on SIGTERM)
_WAITS_IN_FLIGHT: set[threading.Event] = set()


async def _wait_for_file(path: str, timeout_s: float) -> None:
    """Block until the connector's writer releases its lock on `path` (shared flock, like vLLM's reader)."""
    stop = threading.Event()
    _WAITS_IN_FLIGHT.add(stop)
    try:
        await asyncio.to_thread(_wait_unlocked, path, timeout_s, stop)
    finally:
        stop.set()  # a cancelled wait must not leave a thread polling: asyncio.run joins them before it returns
        _WAITS_IN_FLIGHT.discard(stop)


def release_waits() -> None:
    """End every file wait's thread (each polls its stop event every 10 ms)."""
    for stop in list(_WAITS_IN_FLIGHT):
        stop.set()
    _WAITS_IN_FLIGHT.clear()


def _wait_unlocked(path: str, timeout_s: float, stop: threading.Event) -> None:
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout_s

    def give_up() -> bool:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not complete within {timeout_s:.0f} s")
        return stop.wait(0.01)

    while not os.path.exists(lock_path) and not os.path.exists(path):
        if give_up():
            return
    if os.path.exists(lock_path):
        with open(lock_path) as handle:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if give_up():
                        return
        os.unlink(lock_path)


async def _request_one(client: Any, server: VLLMServer, sample: Sample, settings: ClientSettings) -> str:
    import httpx

    body = {
        "model": server.spec.served_model_name,
        "prompt": sample.input_ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    last_error: BaseException | None = None
    for attempt in range(settings.max_retries + 1):
        try:
            response = await client.post(
                f"{server.base_url}/v1/completions",
                json=body,
                headers=server.headers(),
                timeout=settings.request_timeout_s,
            )
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            server.check()  # a dead server is not retried: it fails the stage with its log
            last_error = exc
            await asyncio.sleep(min(2**attempt, 30))
            continue
        if response.status_code >= 500:
            server.check()
            last_error = RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            await asyncio.sleep(min(2**attempt, 30))
            continue
        if response.status_code != 200:
            raise StageError(
                f"row {sample.row}: the server rejected the request with HTTP {response.status_code}: "
                f"{response.text[:1000]}"
            )
        payload = response.json()
        params = payload.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise StageError(
                f"row {sample.row}: the response has no kv_transfer_params.hidden_states_path "
                f"(is the hidden-states connector configured?): {json.dumps(payload)[:800]}"
            )
        echoed = (payload.get("choices") or [{}])[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != sample.input_ids:
            raise StageError(
                f"row {sample.row}: the server tokenised the prompt differently "
                f"({len(echoed)} ids back for {len(sample.input_ids)} sent)"
            )
        return path
    raise StageError(f"row {sample.row}: request failed after {settings.max_retries + 1} attempts: {last_error!r}")


async def _extract_async(
    server: VLLMServer,
    samples: list[Sample],
    files: HiddenStateFiles,
    *,
    settings: ClientSettings,
    tracker: ProgressTracker,
    on_file: Callable[[Sample, Path], None] | None,
) -> int:
    import httpx

    semaphore = asyncio.Semaphore(settings.concurrency)
    bytes_written = 0
    completed_this_run = 0

    async def request(client: httpx.AsyncClient, sample: Sample) -> tuple[str, float]:
        """The sample's file written by the server, and when its request was sent (a sample's latency, which the
        stall limit scales with, starts there: not while it waited for a slot)."""
        if settings.fail_after_samples is not None and completed_this_run >= settings.fail_after_samples:
            raise StageError(
                f"fault injection: extraction.fail_after_samples={settings.fail_after_samples} "
                "stopped this replica on purpose"
            )
        sent = time.monotonic()
        tracker.in_flight += 1
        try:
            produced = await _request_one(client, server, sample, settings)
            await _wait_for_file(produced, settings.request_timeout_s)
        finally:
            tracker.in_flight -= 1
        return produced, sent

    async def one(client: httpx.AsyncClient, sample: Sample) -> None:
        nonlocal bytes_written, completed_this_run

        produced, sent = await request_in_slot_then_check(
            semaphore, lambda: request(client, sample), lambda done: _check_sample_file(Path(done[0]), sample, files)
        )
        # the rename and the count together, in the loop: a stop (a dead server cancels the tasks) never leaves a
        # file under its final name that progress.json does not count
        final, size = _keep_sample_file(Path(produced), files.path(sample.row))
        bytes_written += size
        completed_this_run += 1
        tracker.add(len(sample.input_ids), time.monotonic() - sent)
        if on_file is not None:
            on_file(sample, final)

    limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
    tracker.report_period_s = settings.progress_interval_s
    tracker.last_finished = time.monotonic()
    async with httpx.AsyncClient(limits=limits) as client:
        tasks = [asyncio.create_task(one(client, s)) for s in samples]
        await _run_guarded(tasks, _watch_server(server, tracker, settings), _report_progress(tracker, settings))
    return bytes_written


async def request_in_slot_then_check(
    slot: asyncio.Semaphore, request: Callable[[], Awaitable[T]], check: Callable[[T], object]
) -> T:
    """`request()` holds one of the client's `concurrency` slots (the server's work: the prefill and the file's
    write); `check(result)`, blocking file reads without side effects, runs in a thread after the slot is given
    back, so the server gets the next request while a finished sample's file is checked, and the event loop is not
    blocked by it. On the 8B shape (one H100, 2026-12-07) the check and rename inside the slot cost 1.0% of
    extraction's wall against vLLM's connector alone: bench/gpu/results/2026-12-07-llama8b-shape-1200/."""
    async with slot:
        result = await request()
    await asyncio.to_thread(check, result)
    return result


def _check_sample_file(produced: Path, sample: Sample, files: HiddenStateFiles) -> None:
    """Raise StageError unless the file the server wrote for a sample holds its states and token ids."""
    reason = files.check(produced, sample.input_ids, full=False)
    if reason is not None:
        raise StageError(f"row {sample.row}: the file the server wrote ({produced}) is invalid: {reason}")


def _keep_sample_file(produced: Path, final: Path) -> tuple[Path, int]:
    """Move a checked sample file to its final name (atomic); returns the final path and its size."""
    # vLLM's connector writes 0600: the group's jobs (training as another user) must read it
    os.chmod(produced, 0o666 & ~process_umask())
    os.replace(produced, final)  # atomic: a reader sees no file or the whole file
    return final, final.stat().st_size


async def _watch_server(server: VLLMServer, tracker: ProgressTracker, settings: ClientSettings) -> None:
    while True:
        server.check()  # a dead server: ServerFailure with its log
        check_stall(server, tracker, settings)
        await asyncio.sleep(0.5)


async def _report_progress(tracker: ProgressTracker, settings: ClientSettings) -> None:
    while True:
        await asyncio.sleep(settings.progress_interval_s)
        tracker.write()


async def _run_guarded(tasks: list[asyncio.Task], watchdog: Any, reporter: Any) -> None:
    """Await `tasks` while the watchdog may fail them all; whatever happens, every task ends and is drained."""
    gathered = asyncio.gather(*tasks)
    guard = asyncio.create_task(watchdog)
    report = asyncio.create_task(reporter)
    try:
        done, _ = await asyncio.wait({gathered, guard, report}, return_when=asyncio.FIRST_COMPLETED)
        for watcher in (guard, report):
            if watcher in done:
                watcher.result()  # the watchdog's ServerFailure or ServerStalled; a progress file that cannot be written
        await gathered
    finally:
        for task in (*tasks, guard, report):
            task.cancel()
        # Drain everything, the gather future included: an exception nobody retrieved is printed by asyncio
        # at garbage collection, i.e. after (and burying) the stage's FAILED block.
        await asyncio.gather(*tasks, gathered, guard, report, return_exceptions=True)


def check_stall(server: VLLMServer, tracker: ProgressTracker, settings: ClientSettings) -> None:
    """Raise ServerStalled when requests are in flight and nothing finished for the stall limit."""
    limit = stall_limit_s(settings.stall_timeout_s, settings.stall_factor, tracker.slowest_sample_s)
    idle = tracker.idle_s()
    if tracker.in_flight == 0 or idle <= limit:
        return
    tail = "\n".join(list(server.tail)[-40:])
    raise ServerStalled(
        f"no progress for {idle:.0f} s; server alive but not answering ({tracker.in_flight} requests in flight, "
        f"{tracker.done}/{tracker.total} samples done; limit {limit:.0f} s = max(extraction.stall_timeout_s="
        f"{settings.stall_timeout_s:g}, extraction.stall_factor={settings.stall_factor:g} x slowest sample "
        f"{tracker.slowest_sample_s:.1f} s)). A hung engine looks like this: a wedged GPU, a stuck NCCL "
        "collective, a stopped process. Check the GPUs (nvidia-smi) and the log below, then rerun (finished "
        f"samples are kept); raise extraction.stall_timeout_s if samples are legitimately this slow.\n"
        f"last server log lines:\n{tail}"
    )


def extract_samples(
    server: VLLMServer,
    samples: list[Sample],
    files: HiddenStateFiles,
    *,
    settings: ClientSettings,
    tracker: ProgressTracker,
    on_file: Callable[[Sample, Path], None] | None = None,
) -> int:
    """Extract `samples` through a ready server into `files`' folder; returns bytes written. Raises StageError."""
    files.folder.mkdir(parents=True, exist_ok=True)
    if not samples:
        return 0
    try:
        return asyncio.run(_extract_async(server, samples, files, settings=settings, tracker=tracker, on_file=on_file))
    except ServerFailure:
        raise
    except StageError:
        server.check()  # prefer the server's cause when it died under the client
        raise
    finally:
        release_waits()  # however the loop ended (a stop signal mid-task included), no wait thread outlives it
