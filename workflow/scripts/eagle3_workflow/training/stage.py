"""Stage `train_draft`: check the inputs, prepare the resumable work directory, run the trainer until the last
epoch's checkpoint exists, and publish the draft. ``main(snakemake)`` is the rule's adapter.

train.hidden_states: offline reads every row's hidden-state file; online starts the trainer's own vLLM server for
each launch and the trainer generates each sample on demand (training/online.py)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.data_artefacts import CanaryReport, ValidationReport
from eagle3_workflow.files.draft_artefacts import CheckpointInfo, OnlineTrainingStats, TrainingSummary
from eagle3_workflow.files.hidden_states import hs_file
from eagle3_workflow.files.prepared import open_prepared
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import TrainSettings
from eagle3_workflow.settings.stages import TrainDraftOnlineStage, rule_settings_model
from eagle3_workflow.settings.views import stage_settings
from eagle3_workflow.trainer.command import TrainDevice, TrainPaths, build_train_command, resolve_device
from eagle3_workflow.training.checkpoint_space import checkpoint_needs, require_checkpoint_space
from eagle3_workflow.training.checkpoints import outlook_on_disk, prepare_resume, resume_point
from eagle3_workflow.training.launcher import run_attempt, trainer_env
from eagle3_workflow.training.metrics import attempt_metrics, final_metrics, metrics_table
from eagle3_workflow.training.online import (
    OnlineFolders,
    OnlineServing,
    OnlineWatch,
    online_server,
    online_stats,
    online_trainer_arguments,
    online_trainer_env,
    split_devices,
    visible_devices,
)
from eagle3_workflow.training.publish import publish_draft
from eagle3_workflow.training.workdir import (
    ensure_vocab_mapping,
    reconcile_work_dir,
    sha256_file,
    stage_training_data,
    target_vocab_size,
    training_fingerprint,
)

log = logging.getLogger("eagle3.training")


def _check_inputs(
    settings: TrainSettings,
    *,
    prepared: Path,
    files_dir: Path,
    api_compat: ApiCompatReport,
    validation: ValidationReport,
) -> tuple[list[int], str, int]:
    """Target layer ids, the on-missing policy and the number of rows, or StageError naming what to fix."""
    layer_ids = list(api_compat.layer_ids)
    if len(layer_ids) < 2:
        raise StageError(f"api_compat.json lists layer_ids {layer_ids}: need the draft's ids plus the verifier's last")
    target_layer_ids = layer_ids[:-1]
    if len(set(target_layer_ids)) != len(target_layer_ids):
        raise StageError(
            f"target layer ids {target_layer_ids} (api_compat layer_ids minus the last) contain duplicates; "
            "set hidden_states.layer_ids to distinct ids"
        )
    if not validation.passed:
        raise StageError("hidden_states/validation.json says the hidden states did not pass validation")
    if validation.layer_count != len(layer_ids):
        raise StageError(
            f"the hidden-state files hold {validation.layer_count} layers but api_compat.json lists {len(layer_ids)} layer ids "
            f"{layer_ids}; rerun extract_hidden_states with the current configuration"
        )
    rows = len(open_prepared(prepared))
    train_rows = int(rows * settings.train_data_ratio)
    if train_rows < 1 or train_rows >= rows:
        raise StageError(
            f"train.train_data_ratio={settings.train_data_ratio} splits {rows} prepared rows into {train_rows} for "
            f"training and {rows - train_rows} for validation; both need at least one row"
        )
    if settings.hidden_states == "online":
        return target_layer_ids, "generate", rows  # validation covered the check set; the rest is generated
    tolerated = [*validation.missing, *validation.bad]
    missing = [row for row in range(rows) if not hs_file(files_dir, row).exists()]
    if missing and not tolerated:
        raise StageError(
            f"{len(missing)} of {rows} hidden-state files are missing in {files_dir} (first rows: {missing[:10]}) "
            "although validation passed; rerun extract_hidden_states and validate_hidden_states"
        )
    # samples the validation tolerated (validation.max_bad_samples) are skipped with a warning, not fatal
    return target_layer_ids, "warn" if tolerated else "raise", rows


def _visible_device(settings: TrainSettings) -> TrainDevice:
    import os

    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve_device(settings.gpus, cuda, settings.cpu_processes, len(os.sched_getaffinity(0)))


@dataclasses.dataclass(frozen=True)
class _Sources:
    """The stage's inputs and its work directory, as paths."""

    target: Path
    prepared: Path
    token_freq: Path
    validation: Path
    files_dir: Path
    work_dir: Path


def _prepare_work_dir(
    settings: TrainSettings, sources: _Sources, *, rows: int, layer_ids: list[int], trust_remote_code: bool
) -> tuple[TrainPaths, dict[str, str], CheckpointInfo | None]:
    """Keep or clear train_work, link the data into it, build (or check) the vocab mapping: the trainer's paths,
    the mapping's sha256s and the checkpoint to resume from (None: from scratch)."""
    fingerprint = training_fingerprint(
        settings,
        target=sources.target,
        prepared=sources.prepared,
        token_freq=sources.token_freq,
        validation=sources.validation,
        files_dir=sources.files_dir,
        rows=rows,
        target_layer_ids=layer_ids,
    )
    kept = reconcile_work_dir(sources.work_dir, fingerprint)
    paths = TrainPaths.in_work_dir(sources.work_dir, sources.target, settings.draft_vocab_size)
    # online: no hidden_states/ in the data directory, so the trainer finds no sample cached and generates each
    files_dir = sources.files_dir if settings.hidden_states == "offline" else None
    stage_training_data(paths.data_dir, prepared=sources.prepared, token_freq=sources.token_freq, files_dir=files_dir)
    built = ensure_vocab_mapping(
        paths,
        token_freq=sources.token_freq,
        draft_vocab_size=settings.draft_vocab_size,
        vocab_size=target_vocab_size(sources.target, trust_remote_code),
    )
    mapping_sha = {"d2t": sha256_file(paths.d2t), "t2d": sha256_file(paths.t2d)}
    log.info(
        "vocab mapping %s (d2t %s, t2d %s)",
        "built" if built else "reused",
        mapping_sha["d2t"][:12],
        mapping_sha["t2d"][:12],
    )
    return paths, mapping_sha, _resume_point(paths.save_dir, kept)


def _resume_point(save_dir: Path, kept: bool) -> CheckpointInfo | None:
    """The newest complete state of a kept work directory (interrupted/ included, half-written ones removed),
    or None: from scratch."""
    resumed_from = prepare_resume(save_dir) if kept else None
    if resumed_from is not None:
        log.info("resuming from checkpoint %s: %s", resumed_from.path, resume_point(resumed_from))
    else:
        log.info("no checkpoint in %s: training from scratch", save_dir)
    return resumed_from


def _room_for_checkpoints(
    settings: TrainSettings, target: Path, save_dir: Path, publish_dir: Path, *, captured_layers: int
) -> int | None:
    """One checkpoint's estimated bytes, once each file system has been found to hold what train_draft still writes
    there: every epoch folder still to be written, and the published draft (StageError with the numbers and the
    fixes if not: issue #41). None, with a warning, for a target config.json the estimate cannot size (speculators
    may still build a draft from it: no reason to refuse)."""
    try:
        needs = checkpoint_needs(target, save_dir, publish_dir, settings=settings, captured_layers=captured_layers)
    except StageError as exc:
        log.warning("the checkpoint disk check is skipped: %s", exc)
        return None
    for folder, need in needs:
        space = require_checkpoint_space(need, folder, margin=settings.disk_margin)
        log.info(
            "checkpoints: %d epoch folder(s) still to write x ~%d bytes, published draft ~%d bytes; %s has %d bytes "
            "free (train.disk_margin %s)",
            len(need.folders), need.per_checkpoint, need.published, space.mount_point, space.free, settings.disk_margin,
        )  # fmt: skip
    return needs[0][1].per_checkpoint


@dataclasses.dataclass(frozen=True)
class _TrainingPlan:
    """How this run trains: the trainer's command on its device (given the online flags, or None offline), the
    target layer ids, the vocab mapping's sha256s and the checkpoint it resumes from (None: from scratch)."""

    command: Callable[[dict[str, Any] | None], list[str]]
    device: TrainDevice
    target_layer_ids: list[int]
    mapping_sha: dict[str, str]
    resumed_from: CheckpointInfo | None
    checkpoint_bytes: int | None = None  # one saved epoch's, estimated (trainer/checkpoint_size.py)


@dataclasses.dataclass
class _Launch:
    """What a launch of the trainer left: the last epoch's checkpoint, the command that ran, the online record."""

    final: CheckpointInfo
    command: list[str]
    online: OnlineTrainingStats | None = None


def _train_to_the_end(
    settings: TrainSettings,
    plan: _TrainingPlan,
    *,
    work_dir: Path,
    cpu_threads: int | None,
    on_line: Callable[[str], None] | None,
    online: OnlineServing | None,
) -> _Launch:
    """The checkpoint of the last epoch: the one already there, or the one a launch of the trainer writes."""
    logs_dir = work_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    device, resumed_from = plan.device, plan.resumed_from
    log.info(
        "training on %s with %d process(es), hidden states %s", device.kind, device.processes, settings.hidden_states
    )
    if resumed_from is not None and resumed_from.ends_training(settings.epochs):
        # a forced rerun with the same inputs: the trainer would load the checkpoint and do nothing
        log.info(
            "all %d epochs are already trained in %s: publishing it without starting the trainer (delete %s to "
            "train again from scratch)",
            settings.epochs,
            resumed_from.path,
            work_dir,
        )
        return _Launch(resumed_from, plan.command(None))
    env = trainer_env(device, cpu_threads)
    attempt = {"logs_dir": logs_dir, "save_dir": work_dir / "checkpoints", "epochs": settings.epochs,
               "checkpoint_bytes": plan.checkpoint_bytes}  # fmt: skip
    attempt["on_line"] = on_line or (lambda line: log.info("| %s", line))
    if online is None:
        command = plan.command(None)
        return _Launch(run_attempt(command, env=env, **attempt), command)
    folders = OnlineFolders(work_dir / "online")
    server_devices = None
    if online.device == "cuda":
        server_devices, trainer_devices = _split_job_gpus(device, online)
        if device.kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(trainer_devices)
    with online_server(online, folders, devices=server_devices) as server:
        watch = OnlineWatch(server, folders, online.stall())
        command = plan.command(online_trainer_arguments(online, f"{server.base_url}/v1"))
        env |= online_trainer_env(online, folders, server.api_key)
        final = run_attempt(command, env=env, watch=watch, **attempt)
        return _Launch(final, command, online_stats(folders, watch, server.ready_s))


def _split_job_gpus(device: TrainDevice, online: OnlineServing) -> tuple[list[str], list[str]]:
    import torch

    visible = visible_devices(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    trainer_gpus = device.processes if device.kind == "cuda" else 0
    server, trainer = split_devices(visible, trainer_gpus=trainer_gpus, server_gpus=online.settings.server_gpus)
    log.info("online training: the vLLM server on GPU(s) %s, the trainer on %s", server, trainer or "the CPU")
    return server, trainer


def _summarise(
    settings: TrainSettings, plan: _TrainingPlan, launch: _Launch, *, logs_dir: Path, started: float
) -> tuple[Any, TrainingSummary]:
    """(metrics table, draft/training.json) from every launch's metric records."""
    attempts = attempt_metrics(logs_dir)
    metrics = metrics_table(attempts)
    final_loss, final_val_loss, full_acc = final_metrics(metrics, logs_dir)
    final = launch.final
    summary = TrainingSummary(
        device=plan.device.kind,
        processes=plan.device.processes,
        command=launch.command,
        attempts=len(attempts),
        resumed_from=plan.resumed_from,
        final_checkpoint=final,
        epochs=settings.epochs,
        steps=final.global_step,
        wall_s=round(time.monotonic() - started, 2),
        target_layer_ids=list(plan.target_layer_ids),
        draft_vocab_size=settings.draft_vocab_size,
        vocab_mapping_sha256=plan.mapping_sha,
        final_train_loss=final_loss,
        final_val_loss=final_val_loss,
        final_val_full_acc=full_acc,
        hidden_states=settings.hidden_states,
        online=launch.online,
    )
    return metrics, summary


def train_draft(
    settings: TrainSettings,
    *,
    target: Path,
    prepared: Path,
    token_freq: Path,
    api_compat: Path,
    validation: Path,
    files_dir: Path,
    work_dir: Path,
    out_dir: Path,
    trust_remote_code: bool,
    cpu_threads: int | None = None,
    device: TrainDevice | None = None,
    on_line: Callable[[str], None] | None = None,
    online: OnlineServing | None = None,
) -> TrainingSummary:
    """Train (or resume training) the draft in ``work_dir`` and publish it to ``out_dir``. ``online`` (required when
    settings.hidden_states is online): the server the trainer generates hidden states from."""
    if (online is None) != (settings.hidden_states == "offline"):
        raise StageError(f"train.hidden_states is {settings.hidden_states} but the stage was given no server to serve it"
                         if online is None else "an online server was given to offline training")  # fmt: skip
    started = time.monotonic()
    sources = _Sources(*(Path(p) for p in (target, prepared, token_freq, validation, files_dir, work_dir)))
    device = device if device is not None else _visible_device(settings)
    layer_ids, on_missing, rows = _check_inputs(
        settings,
        prepared=sources.prepared,
        files_dir=sources.files_dir,
        api_compat=load(ApiCompatReport, api_compat),
        validation=load(ValidationReport, validation),
    )
    paths, mapping_sha, resumed_from = _prepare_work_dir(
        settings, sources, rows=rows, layer_ids=layer_ids, trust_remote_code=trust_remote_code
    )

    def command(online_args: dict[str, Any] | None) -> list[str]:
        return build_train_command(settings, paths, device, target_layer_ids=layer_ids, on_missing=on_missing,
                                   trust_remote_code=trust_remote_code, online=online_args)  # fmt: skip

    per_checkpoint = _room_for_checkpoints(
        settings, sources.target, paths.save_dir, Path(out_dir), captured_layers=len(layer_ids)
    )
    plan = _TrainingPlan(command, device, layer_ids, mapping_sha, resumed_from, per_checkpoint)
    launch = _train_to_the_end(
        settings, plan, work_dir=sources.work_dir, cpu_threads=cpu_threads, on_line=on_line, online=online
    )
    final = launch.final
    metrics, summary = _summarise(settings, plan, launch, logs_dir=sources.work_dir / "logs", started=started)
    publish_draft(Path(final.path), Path(out_dir), metrics, summary)
    log.info(
        "draft trained: %d steps in %d epoch(s), final train loss %.4f, val loss %s, full acc per position %s -> %s",
        final.global_step,
        settings.epochs,
        summary.final_train_loss,
        summary.final_val_loss,
        [round(a, 3) for a in summary.final_val_full_acc],
        out_dir,
    )
    return summary


def online_serving(settings: TrainDraftOnlineStage, api: ApiCompatReport, target: str) -> OnlineServing:
    """The online trainer's server: the canary's and extraction's (same builder, the run's layer ids), serving the
    target under its path (the name speculators asks the endpoint for), sized by train.online, watched for stalls
    as extraction's server is (extraction.stall_timeout_s, stall_factor)."""
    from eagle3_workflow.reference.target_config import read_target_config
    from eagle3_workflow.runtime.child import ProgressWatch
    from eagle3_workflow.serving.engine import hidden_states_server_spec

    def server_spec(storage_dir: str) -> Any:
        spec = hidden_states_server_spec(settings, model=target, layer_ids=api.layer_ids, storage_dir=storage_dir,
                                         device=api.device, enable_render_endpoint=False)  # fmt: skip
        return dataclasses.replace(
            spec, served_model_name=target, gpu_memory_utilization=settings.train.online.gpu_memory_utilization
        )

    dtype = settings.target.dtype
    if dtype == "auto":
        dtype = read_target_config(target).dtype or "bfloat16"
    extraction = settings.extraction

    def stall() -> ProgressWatch:
        return ProgressWatch(floor_s=extraction.stall_timeout_s, factor=extraction.stall_factor,
                             setting="extraction.stall_timeout_s")  # fmt: skip

    return OnlineServing(
        server_spec, api.device, settings.train.online, stall, len(api.layer_ids), api.target.hidden_size, dtype
    )


def rerun_after_stop(work_dir: str | Path, epochs: Sequence[int] = ()) -> Callable[[], str]:
    """The stop line's sentence for ``run_stage``: what the rerun will do, read from ``work_dir`` once the trainer
    has stopped (its interrupt save finished or cut short). ``epochs``: filled once the settings are read."""
    work = Path(work_dir)
    return lambda: outlook_on_disk(work / "checkpoints", work / "logs", epochs[-1] if epochs else None)


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    epochs: list[int] = []  # known once the settings are read

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        settings = stage_settings(
            rule_settings_model("train_draft", snakemake.params.settings), snakemake.params.settings
        )
        epochs.append(settings.train.epochs)
        canary = load(CanaryReport, snakemake.input.canary)
        if not canary.passed:
            raise StageError("checks/canary.json says the canary did not pass: training will not start")
        target = str(Path(snakemake.input.target))
        api = load(ApiCompatReport, snakemake.input.api_compat)
        train_draft(
            settings.train,
            target=Path(snakemake.input.target),
            prepared=Path(snakemake.input.prepared),
            token_freq=Path(snakemake.input.token_freq),
            api_compat=Path(snakemake.input.api_compat),
            validation=Path(snakemake.input.validation),
            files_dir=Path(snakemake.params.files_dir),
            work_dir=Path(snakemake.params.work_dir),
            out_dir=Path(snakemake.output.draft),
            trust_remote_code=settings.target.trust_remote_code,
            cpu_threads=snakemake.threads,
            online=online_serving(settings, api, target) if isinstance(settings, TrainDraftOnlineStage) else None,
        )

    run_stage("train_draft", snakemake.log[0], body, resumes=rerun_after_stop(snakemake.params.work_dir, epochs))
