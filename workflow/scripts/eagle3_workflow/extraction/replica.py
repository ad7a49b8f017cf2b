"""Stage `extract_hidden_states`: one replica's shard, through a vLLM server this stage owns.

Flow: disk preflight -> resume scan (valid files are kept, partial/invalid ones redone) -> start the server
(vllm_server) -> an async client sends each sample's token ids as a 1-token completion; the connector writes
``<req_id>.safetensors`` into a scratch dir; the client waits for the writer's lock, checks the header and
token ids, and renames the file to ``hs_<row>.safetensors`` (atomic on one filesystem) -> progress.json every
few seconds -> manifest. A watchdog checks the server twice a second: a dead server ends the stage at once.
The canary calls `extract_samples` too, so the gate exercises exactly this path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_workflow.artefacts import (
    ApiCompatReport,
    ExtractionManifest,
    GreedyProbe,
    ProgressSnapshot,
    write,
)
from eagle3_workflow.disk import DiskFullEvidence, disk_full_evidence, space_of
from eagle3_workflow.errors import StageError
from eagle3_workflow.files import process_umask
from eagle3_workflow.hidden_states import HiddenStateFiles, human_bytes, shard_rows
from eagle3_workflow.prepared import read_input_ids
from eagle3_workflow.runtime.stage import StageStopped
from eagle3_workflow.settings import ExtractHiddenStatesStage, ExtractionClient
from eagle3_workflow.vllm_server import ServerFailure, VLLMServer

log = logging.getLogger("eagle3.extraction")


class ServerStalled(StageError):
    """The server is alive but no sample finished for the stall limit while requests were in flight."""


class ServerCannotWrite(StageError):
    """The server said its disk is full: the client's own error (a missing sample file) was only the consequence."""


class DiskFull(StageError):
    """The disk filled up during extraction (another job, after the preflight passed): where, what is safe, the fix."""


def stall_limit_s(floor_s: float, factor: float, slowest_sample_s: float) -> float:
    """How long the client waits for the next finished sample: the floor, or more when samples are slow."""
    return max(floor_s, factor * slowest_sample_s)


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


def disk_preflight(
    samples: list[Sample], files: HiddenStateFiles, *, margin: float, available_override: int | None
) -> tuple[int, int]:
    """Refuse to start (StageError with the numbers) when the filesystem cannot hold the output."""
    needed = files.estimate_bytes([len(s.input_ids) for s in samples])
    files.folder.mkdir(parents=True, exist_ok=True)
    available = available_override if available_override is not None else shutil.disk_usage(files.folder).free
    if needed * margin > available:
        raise StageError(
            f"not enough disk for hidden states: {len(samples)} samples, {sum(len(s.input_ids) for s in samples)} "
            f"tokens x {files.layer_count} layers x hidden {files.hidden_size} x 2 B = {human_bytes(needed)} "
            f"(x{margin} margin = {human_bytes(needed * margin)}), but {files.folder} has {human_bytes(available)} "
            "free. Free space, point results/ at a larger filesystem, split into more replicas on other "
            "filesystems, or lower extraction.disk_margin if you know the estimate is pessimistic."
        )
    return needed, available


def resume_scan(samples: list[Sample], files: HiddenStateFiles) -> tuple[list[Sample], list[Sample], dict[int, str]]:
    """Split into (already done and valid, to do); invalid or partial files are deleted and redone."""
    done, todo, redone = [], [], {}
    for sample in samples:
        path = files.path(sample.row)
        if not path.exists():
            todo.append(sample)
            continue
        reason = files.check(path, sample.input_ids, full=False)
        if reason is None:
            done.append(sample)
        else:
            redone[sample.row] = reason
            path.unlink(missing_ok=True)
            todo.append(sample)
    return done, todo, redone


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


async def _wait_for_file(path: str, timeout_s: float) -> None:
    """Block until the connector's writer releases its lock on `path` (shared flock, like vLLM's reader)."""
    stop = threading.Event()
    try:
        await asyncio.to_thread(_wait_unlocked, path, timeout_s, stop)
    finally:
        stop.set()  # a cancelled wait must not leave a thread polling: asyncio.run joins them before it returns


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

    async def one(client: httpx.AsyncClient, sample: Sample) -> None:
        nonlocal bytes_written, completed_this_run
        async with semaphore:
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
            final = _keep_sample_file(Path(produced), sample, files)
            bytes_written += final.stat().st_size
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


def _keep_sample_file(produced: Path, sample: Sample, files: HiddenStateFiles) -> Path:
    """Check the file the server wrote for a sample, then move it to its final name (atomic)."""
    reason = files.check(produced, sample.input_ids, full=False)
    if reason is not None:
        raise StageError(f"row {sample.row}: the file the server wrote ({produced}) is invalid: {reason}")
    final = files.path(sample.row)
    # vLLM's connector writes 0600: the group's jobs (training as another user) must read it
    os.chmod(produced, 0o666 & ~process_umask())
    os.replace(produced, final)  # atomic: a reader sees no file or the whole file
    return final


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


def parse_greedy_probe(row: int, payload: dict[str, Any]) -> GreedyProbe:
    """The server's greedy next token and its top logprobs (token ids, via return_tokens_as_token_ids)."""
    choice = (payload.get("choices") or [{}])[0]
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    top = (logprobs.get("top_logprobs") or [{}])[0] or {}
    if not tokens or not str(tokens[0]).startswith("token_id:"):
        raise StageError(f"row {row}: greedy probe response has no token ids in logprobs: {json.dumps(payload)[:600]}")
    return GreedyProbe(
        row=row,
        token_id=int(str(tokens[0]).split(":", 1)[1]),
        top_logprobs={str(k).split(":", 1)[1]: float(v) for k, v in top.items()},
    )


def greedy_probes(server: VLLMServer, samples: list[Sample], timeout_s: float) -> list[GreedyProbe]:
    """One extra request per sample: the server's own greedy next token after the whole sample.

    validate_hidden_states applies the target's final norm and lm_head to the captured id N at the last
    position and must find the same token: a capture that is wrong on the full model (which the canary's
    slice cannot see) is caught there.
    """
    import httpx

    probes = []
    for sample in samples:
        body = {
            "model": server.spec.served_model_name,
            "prompt": sample.input_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        }
        response = httpx.post(
            f"{server.base_url}/v1/completions", json=body, headers=server.headers(), timeout=timeout_s
        )
        if response.status_code != 200:
            server.check()
            raise StageError(f"row {sample.row}: greedy probe HTTP {response.status_code}: {response.text[:500]}")
        probes.append(parse_greedy_probe(sample.row, response.json()))
    return probes


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaRequest:
    """One replica's extraction: its shard of the prepared rows, where its files go, how its server starts."""

    prepared_dir: Path
    replica: int
    replicas: int
    files: HiddenStateFiles
    scratch_dir: Path  # the server writes here; each file is checked, then moved into files.folder
    server_spec_factory: Callable[[str], Any]  # storage dir -> the server's spec
    server_log: Path
    disk_margin: float
    available_bytes_override: int | None = None
    probe_samples: int = 0  # the shard's first rows get a greedy probe each (validate_hidden_states checks them)
    progress_path: Path | None = None
    manifest_path: Path | None = None  # the manifest is also written here when given


@dataclasses.dataclass
class ReplicaPlan:
    """One replica's shard: its rows and samples, those already valid on disk, those left to extract."""

    rows: list[int]
    samples: list[Sample]
    done: list[Sample]
    todo: list[Sample]


@dataclasses.dataclass
class ServedRun:
    """What the replica's server and client did: bytes written, the server's start-up, the probes, the client's time."""

    bytes_written: int = 0
    ready_s: float = 0.0
    probes: list[GreedyProbe] = dataclasses.field(default_factory=list)
    client_started: float = dataclasses.field(default_factory=time.monotonic)


def extract_replica(request: ReplicaRequest, settings: ClientSettings) -> ExtractionManifest:
    """The whole replica: resume scan, disk preflight, server, client, manifest (written to the request's
    `manifest_path` when given). However it ends (done, an error, a full disk, a stop signal), progress.json ends in
    that state with the samples truly on disk; a full disk fails as DiskFull, which names the file system and what is
    safe."""
    started = time.monotonic()
    plan = _plan_replica(request)
    tracker = ProgressTracker(request.progress_path, request.replica, len(plan.samples), len(plan.done))
    try:
        needed, available = disk_preflight(
            plan.todo, request.files, margin=request.disk_margin, available_override=request.available_bytes_override
        )
        log.info(
            "disk preflight: need %s (x%.2f margin), %s free",
            human_bytes(needed),
            request.disk_margin,
            human_bytes(available),
        )
        tracker.write("starting the vLLM server" if plan.todo else "nothing to extract")
        run = _serve_and_extract(request, plan, settings, tracker) if plan.todo else ServedRun()
        manifest = _manifest(request, plan, run, wall_s=time.monotonic() - started)
        if request.manifest_path is not None:
            write(request.manifest_path, manifest)
    except BaseException as exc:
        disk_full = _end_failed_replica(exc, tracker, request, plan)
        if disk_full is None:
            raise
        raise disk_full from exc
    tracker.finish("done", "done")
    return manifest


def _manifest(request: ReplicaRequest, plan: ReplicaPlan, run: ServedRun, *, wall_s: float) -> ExtractionManifest:
    tokens = sum(len(s.input_ids) for s in plan.todo)
    client_s = time.monotonic() - run.client_started
    return ExtractionManifest(
        replica=request.replica,
        replicas=request.replicas,
        samples_total=len(plan.samples),
        samples_extracted=len(plan.todo),
        samples_reused=len(plan.done),
        tokens=tokens,
        bytes_written=run.bytes_written,
        wall_s=round(wall_s, 2),
        server_ready_s=round(run.ready_s, 2),
        tokens_per_s=round(tokens / client_s, 1) if plan.todo and client_s > 0 else 0.0,
        files_dir=str(request.files.folder),
        rows=plan.rows,
        greedy_probes=run.probes,
    )


def _end_failed_replica(
    exc: BaseException, tracker: ProgressTracker, request: ReplicaRequest, plan: ReplicaPlan
) -> DiskFull | None:
    """After a failure or a stop: remove the scratch files (never trusted, and maybe what filled the disk), name a
    full disk (the DiskFull to raise instead), and leave progress.json in its last state."""
    files_dir, scratch_dir = request.files.folder, request.scratch_dir
    shutil.rmtree(scratch_dir, ignore_errors=True)
    if isinstance(exc, StageStopped):
        tracker.finish("stopped", f"stopped by {exc.signal_name}; {tracker.done} samples kept, the rerun resumes")
        return None
    evidence = disk_full_evidence(exc, files_dir, quoted_folder=scratch_dir)
    if evidence is None:
        state = "stalled" if isinstance(exc, ServerStalled) else "failed"
        tracker.finish(state, f"{state}: {exc!r}")
        return None
    left = [len(s.input_ids) for s in plan.todo]
    left_bytes = request.files.estimate_bytes(left) * (tracker.total - tracker.done) // max(len(left), 1)
    message = disk_full_message(evidence, kept=tracker.done, total=tracker.total, files_dir=files_dir,
                                left_bytes=left_bytes)  # fmt: skip
    tracker.finish("failed", message.splitlines()[0])
    return DiskFull(message)


def disk_full_message(evidence: DiskFullEvidence, *, kept: int, total: int, files_dir: Path, left_bytes: int) -> str:
    """What filled up, how much is free now, which samples are safe, and what to do."""
    space = space_of(evidence.folder)
    limit, free_up = (
        ("disk quota exceeded", "raise your quota or free space") if evidence.quota else ("disk full", "free space")
    )
    return (
        f"{limit}: {space.mount_point} (the file system holding {evidence.folder}) has {human_bytes(space.free)} "
        f"free now (of {human_bytes(space.total)}).\n"
        f"what failed: {evidence.what}\n"
        f"{kept} of {total} samples are safe on disk (checked files in {files_dir}); the rerun keeps them and "
        f"extracts the other {total - kept} (about {human_bytes(left_bytes)}).\n"
        f"Fix: {free_up} on {space.mount_point} (another job may have filled it after the disk preflight passed), or "
        "move the run's results folder to a bigger file system and leave a symlink in its place; then rerun the same "
        "command: it resumes."
    )


def _plan_replica(request: ReplicaRequest) -> ReplicaPlan:
    """The replica's shard, what is already valid on disk and what is left."""
    replica, replicas = request.replica, request.replicas
    all_ids = read_input_ids(request.prepared_dir)
    rows = shard_rows(len(all_ids), replicas, replica)
    samples = [Sample(r, all_ids[r]) for r in rows]
    done, todo, redone = resume_scan(samples, request.files)
    for row, reason in list(redone.items())[:20]:
        log.warning("row %d: existing file is invalid (%s); it will be extracted again", row, reason)
    log.info(
        "replica %d/%d: %d samples in shard, %d already valid on disk, %d to extract",
        replica,
        replicas,
        len(samples),
        len(done),
        len(todo),
    )
    return ReplicaPlan(rows, samples, done, todo)


def _serve_and_extract(
    request: ReplicaRequest, plan: ReplicaPlan, settings: ClientSettings, tracker: ProgressTracker
) -> ServedRun:
    """Start the server, extract the plan's `todo`, probe greedy tokens. A server that said its disk is full is the
    cause of whatever the client saw (ServerCannotWrite)."""
    scratch_dir = request.scratch_dir
    if scratch_dir.exists():
        shutil.rmtree(scratch_dir)  # leftovers of a killed run: never trusted
    scratch_dir.mkdir(parents=True)
    server = VLLMServer(request.server_spec_factory(str(scratch_dir.resolve())), request.server_log)
    try:
        with server:
            tracker.started = client_started = time.monotonic()
            tracker.state = "running"
            tracker.write("server ready")
            bytes_written = extract_samples(server, plan.todo, request.files, settings=settings, tracker=tracker)
            probes = greedy_probes(server, plan.samples[: request.probe_samples], settings.request_timeout_s)
    except Exception as exc:  # not a stop signal: that stays a stop
        if server.disk_full_line is None:
            raise
        raise ServerCannotWrite(f"the vLLM server could not write into {scratch_dir}: {server.disk_full_line}") from exc
    shutil.rmtree(scratch_dir, ignore_errors=True)
    return ServedRun(bytes_written, server.ready_s, probes, client_started)


def server_spec_factory(settings: ExtractHiddenStatesStage, api: ApiCompatReport, target: str) -> Callable[[str], Any]:
    """The extraction server for a storage folder, as the canary starts it (same builder)."""
    from eagle3_workflow.vllm_server import hidden_states_server_spec

    def spec_factory(storage_dir: str):
        return hidden_states_server_spec(settings, model=target, layer_ids=api.layer_ids, storage_dir=storage_dir,
                                         device=api.device, enable_render_endpoint=False)  # fmt: skip

    return spec_factory


def client_settings(extraction: ExtractionClient) -> ClientSettings:
    return ClientSettings(
        concurrency=extraction.concurrency,
        request_timeout_s=extraction.request_timeout_s,
        max_retries=extraction.max_retries,
        progress_interval_s=extraction.progress_interval_s,
        fail_after_samples=extraction.fail_after_samples,
        stall_timeout_s=extraction.stall_timeout_s,
        stall_factor=extraction.stall_factor,
    )
