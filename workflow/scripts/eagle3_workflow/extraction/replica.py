"""Stage `extract_hidden_states`: one replica's shard, through a vLLM server this stage owns.

Flow: disk preflight -> resume scan (valid files are kept, partial/invalid ones redone) -> start the server
(vllm_server) -> the hidden-state client (extraction_client, shared with the canary, so the gate exercises exactly
this path) extracts every sample left into the replica's folder, progress.json every few seconds -> greedy probes
-> manifest. However the replica ends, progress.json ends in that state; a full disk is named (DiskFull).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.files.data_artefacts import ExtractionManifest, GreedyProbe
from eagle3_workflow.files.disk import DiskFullEvidence, disk_full_evidence, space_of
from eagle3_workflow.files.hidden_states import HiddenStateFiles, human_bytes, rows_on_disk, shard_rows
from eagle3_workflow.files.prepared import read_input_ids
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.runtime.stage import StageStopped, stop_received
from eagle3_workflow.serving.extraction_client import (
    ClientSettings,
    ProgressTracker,
    Sample,
    ServerStalled,
    extract_samples,
)
from eagle3_workflow.serving.server import VLLMServer
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import ExtractionClient
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage

log = logging.getLogger("eagle3.extraction")


class ServerCannotWrite(StageError):
    """The server said its disk is full: the client's own error (a missing sample file) was only the consequence."""


class DiskFull(StageError):
    """The disk filled up during extraction (another job, after the preflight passed): where, what is safe, the fix."""


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
    online_check_samples: int | None = None  # train.hidden_states online: only the check set (rows_on_disk)


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
    stop = exc if isinstance(exc, StageStopped) else stop_received()
    if stop is not None:  # a failure after a stop signal is the stop's consequence (run_stage says so too)
        tracker.finish("stopped", f"stopped by {stop.signal_name}; {tracker.done} samples kept, the rerun resumes")
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
    on_disk = set(rows_on_disk([len(ids) for ids in all_ids], request.online_check_samples))
    rows = [row for row in shard_rows(len(all_ids), replicas, replica) if row in on_disk]
    if request.online_check_samples is not None:
        log.info("online training: extracting the check set only (%d of %d rows)", len(on_disk), len(all_ids))
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
    from eagle3_workflow.serving.engine import hidden_states_server_spec

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
