"""train.hidden_states: online, the stage's side: the trainer's own vLLM server, how the job's GPUs are split between
server and trainer, the trainer's extra flags and environment, and the watch that ends training when the server
dies (the trainer's side, the per-sample checks and the failure policy: ``trainer.online_samples``).

The server is the one the canary proved: ``serving.engine.hidden_states_server_spec`` with the run's layer ids, a
storage folder under ``train_work/online/`` and the target's path as its served name (speculators checks that
the endpoint serves the model it was given). It is a runtime child like every other server: stopped with the
stage, killed with it on SIGKILL, its log streamed into the rule's log, a fatal line or its exit ending training
with the server's own lines quoted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.draft_artefacts import OnlineTrainingStats
from eagle3_workflow.runtime.child import PROGRESS_MARKER, ProgressWatch
from eagle3_workflow.serving.engine import ServerSpec
from eagle3_workflow.serving.server import VLLMServer
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import OnlineTraining
from eagle3_workflow.trainer.online_spec import API_KEY_ENV, ONLINE_SPEC_ENV, OnlineSpec, failed_rows, samples_checked

log = logging.getLogger("eagle3.training")


@dataclasses.dataclass(frozen=True)
class OnlineServing:
    """What online training needs besides the train settings: the server to start for a storage folder (built by
    the adapter from the stage's serving settings and api_compat.json) and the shape every sample must have."""

    server_spec: Callable[[str], ServerSpec]
    device: str  # the server's: cuda or cpu (api_compat.json's)
    settings: OnlineTraining
    stall: Callable[[], ProgressWatch]  # a fresh stall watch for each launch
    layer_count: int
    hidden_size: int
    dtype: str  # the hidden states' torch dtype name: the target's


@dataclasses.dataclass(frozen=True)
class OnlineFolders:
    """train_work/online/: the server's output (emptied before each launch), and what the trainer records."""

    root: Path

    @property
    def storage(self) -> Path:
        return self.root / "hidden_states"

    @property
    def failures(self) -> Path:
        return self.root / "failed_samples.jsonl"

    @property
    def counts(self) -> Path:
        return self.root / "counts"

    @property
    def server_log(self) -> Path:
        return self.root / "vllm_server.log"


def split_devices(visible: Sequence[str], *, trainer_gpus: int, server_gpus: int) -> tuple[list[str], list[str]]:
    """(the server's devices, the trainer's) out of the job's visible devices: the server's first, then the
    trainer's; server_gpus 0 = the server shares the trainer's first device. Refused when too few are visible."""
    wanted = trainer_gpus + server_gpus
    if len(visible) < max(1, wanted):
        raise StageError(
            f"online training needs {max(1, wanted)} GPU(s) (train.gpus={trainer_gpus} for the trainer + "
            f"train.online.server_gpus={server_gpus} for its vLLM server) but the job sees {len(visible)} "
            f"({list(visible)}); request more GPUs or lower the split (server_gpus: 0 shares the trainer's first GPU)"
        )
    if server_gpus == 0:
        return list(visible[:1]), list(visible[:trainer_gpus])
    return list(visible[:server_gpus]), list(visible[server_gpus:wanted])


def visible_devices(cuda_devices: int) -> list[str]:
    """The job's CUDA devices as CUDA_VISIBLE_DEVICES names them (set by gpu_placement or the scheduler)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(cuda_devices)]


def online_trainer_arguments(serving: OnlineServing, endpoint: str) -> dict[str, Any]:
    """The speculators flags that make the trainer generate every sample's hidden states on demand."""
    return {
        "on_missing": "generate",
        "vllm_endpoint": endpoint,
        "request_timeout": serving.settings.request_timeout_s,
        "generation_validation_retries": serving.settings.generation_retries,
    }


def online_trainer_env(serving: OnlineServing, folders: OnlineFolders, api_key: str) -> dict[str, str]:
    spec = OnlineSpec(
        layer_count=serving.layer_count,
        hidden_size=serving.hidden_size,
        dtype=serving.dtype,
        failures_path=str(folders.failures),
        counts_dir=str(folders.counts),
        max_failed_samples=serving.settings.max_failed_samples,
        requests_in_flight=serving.settings.requests_in_flight,
    )
    return {ONLINE_SPEC_ENV: spec.to_env(), API_KEY_ENV: api_key}


class OnlineStalled(StageError):
    """The server is alive but no generated sample has arrived for longer than the stall limit."""


class OnlineWatch:
    """Called by the trainer's ChildProcess twice a second: raises the server's failure, or a stall (samples
    stopped arriving although the server is alive), and keeps the high-water mark of the server's output folder.
    What it raises stops the trainer (it saves checkpoints/interrupted) and ends the attempt.

    The stall watch is extraction's (``extraction.stall_timeout_s`` and ``stall_factor``): armed by the first
    sample checked, it fails when none follows within max(stall_timeout_s, stall_factor x the slowest interval
    between samples so far), so an epoch's end (a checkpoint saved, validation) widens the limit by itself."""

    def __init__(self, server: VLLMServer, folders: OnlineFolders, stall: ProgressWatch | None = None) -> None:
        self.server, self.folders, self.stall = server, folders, stall
        self.storage = folders.storage
        self.peak_files = self.peak_bytes = 0
        self.samples = 0

    def __call__(self) -> None:
        try:
            self.server.check()
            self.sample()
            self.watch_progress(time.monotonic())
        except StageError:
            # the server goes first: the trainer's pending request then fails at once instead of waiting out its
            # timeout, and the trainer, stopped next, ends within its grace
            self.server.stop()
            raise

    def watch_progress(self, now: float) -> None:
        if self.stall is None:
            return
        samples = samples_checked(self.folders.counts)[0]
        if samples > self.samples:
            self.samples = samples
            self.stall.observe(PROGRESS_MARKER, now)
        quiet = self.stall.stalled_for(now)
        if quiet is not None:
            tail = "\n".join(self.server.tail[-20:])
            raise OnlineStalled(
                f"online training stalled: no generated sample arrived for {quiet:.0f} s after {self.samples} "
                f"(limit {self.stall.limit_s():.0f} s: {self.stall.setting}, or {self.stall.factor:g} times the "
                "slowest interval between samples so far); the vLLM server is alive but not answering. A wedged "
                f"GPU or a stopped engine looks like this. The server's last lines ({self.server.log_path}):\n{tail}"
            )

    def sample(self) -> None:
        files = count = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.storage):
                if entry.name.endswith(".safetensors"):
                    with contextlib.suppress(OSError):
                        files, count = files + 1, count + entry.stat().st_size
        self.peak_files, self.peak_bytes = max(self.peak_files, files), max(self.peak_bytes, count)


@contextlib.contextmanager
def online_server(serving: OnlineServing, folders: OnlineFolders, *, devices: list[str] | None) -> Iterator[VLLMServer]:
    """The trainer's server, ready, for the length of the block; its output folder emptied first (a killed launch's
    files are never trusted). ``devices``: its CUDA devices (None on CPU)."""
    if folders.storage.exists():
        shutil.rmtree(folders.storage)
    folders.storage.mkdir(parents=True)
    spec = serving.server_spec(str(folders.storage.resolve()))
    if devices is not None:
        spec = dataclasses.replace(spec, visible_devices=",".join(devices), tensor_parallel_size=max(1, len(devices)))
    log.info("online training: starting the trainer's vLLM server (log: %s)", folders.server_log)
    with VLLMServer(spec, folders.server_log) as server:
        log.info("online training: vLLM ready after %.1f s on %s", server.ready_s, server.base_url)
        yield server


def online_stats(folders: OnlineFolders, watch: OnlineWatch, server_ready_s: float) -> OnlineTrainingStats:
    """What draft/training.json records of an online run."""
    samples, tokens = samples_checked(folders.counts)
    failed = failed_rows(folders.failures)
    return OnlineTrainingStats(
        server_ready_s=round(server_ready_s, 2),
        samples_checked=samples,
        tokens_checked=tokens,
        failed_samples={str(row): reason for row, reason in sorted(failed.items())},
        peak_files=watch.peak_files,
        peak_bytes=watch.peak_bytes,
    )
