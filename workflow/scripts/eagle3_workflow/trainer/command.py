"""The trainer's command line from the ``train`` settings: which speculators flags this stage sets, and how the
trainer entry is launched (one process, or torchrun for several GPUs or CPU ranks). Pure: no torch, no subprocess."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import TrainSettings

log = logging.getLogger("eagle3.training")


@dataclasses.dataclass(frozen=True)
class TrainPaths:
    """Where the trainer reads and writes (all under ``train_work/`` except the target)."""

    target: Path
    data_dir: Path
    save_dir: Path
    metric_log_dir: Path
    d2t: Path
    t2d: Path

    @classmethod
    def in_work_dir(cls, work_dir: Path, target: Path, draft_vocab_size: int) -> TrainPaths:
        data_dir = work_dir / "data"
        return cls(
            target=target,
            data_dir=data_dir,
            save_dir=work_dir / "checkpoints",
            metric_log_dir=work_dir / "metric_logs",
            d2t=data_dir / f"d2t-{draft_vocab_size}.npy",
            t2d=data_dir / f"t2d-{draft_vocab_size}.npy",
        )


@dataclasses.dataclass(frozen=True)
class TrainDevice:
    kind: str  # "cuda" | "cpu"
    processes: int = 1


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def trainer_arguments(
    settings: TrainSettings,
    paths: TrainPaths,
    device: TrainDevice,
    *,
    target_layer_ids: Sequence[int],
    on_missing: str = "raise",
    trust_remote_code: bool,
    online: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """speculators TrainConfig field -> value, in command-line order; ``online``: the on-demand generation flags
    (training.online.online_trainer_arguments), which replace the on-missing policy."""
    args: dict[str, Any] = {
        "speculator_type": "eagle3",
        "verifier_name_or_path": str(paths.target),
        "trust_remote_code": trust_remote_code,
        "data_path": str(paths.data_dir),
        "save_path": str(paths.save_dir),
        "log_dir": str(paths.metric_log_dir),
        "num_layers": settings.draft_layers,
        "target_layer_ids": list(target_layer_ids),
        "draft_vocab_size": settings.draft_vocab_size,
        "d2t_path": str(paths.d2t),
        "t2d_path": str(paths.t2d),
        "ttt_steps": settings.ttt_steps,
        "lr": settings.lr,
        "optimizer": settings.optimizer,
        "epochs": settings.epochs,
        "total_seq_len": settings.total_seq_len,
        "train_data_ratio": settings.train_data_ratio,
        "num_workers": settings.num_workers,
        "seed": settings.seed,
        "checkpoint_freq": settings.checkpoint_freq,
        # the validate stage proved every file is there: a missing one is a bug, not a reason to call a server
        "on_missing": on_missing,
    }
    if online is not None:
        args |= online
    if device.kind == "cpu":
        # flex attention has no CPU backward; the fused loss needs Triton
        args["draft_attn_impl"] = "sdpa"
        args["loss_implementation"] = "eager"
    return args


# speculators TrainConfig fields (dest names) this stage sets, on any device; check_api verifies each exists.
# The names do not depend on the values: every setting is None here.
TRAINER_FIELDS_USED = list(
    trainer_arguments(
        TrainSettings.model_construct(**dict.fromkeys(TrainSettings.model_fields)),
        TrainPaths.in_work_dir(Path("w"), Path("t"), 2),
        TrainDevice("cpu"),
        target_layer_ids=[],
        trust_remote_code=False,
        online={"on_missing": None, "vllm_endpoint": None, "request_timeout": None, "generation_validation_retries": 0},
    )
)


# speculators train with our metrics handler (and on CPU the shim); its arguments are speculators' own
TRAINER_ENTRY = "eagle3_workflow.trainer.entry"


def build_train_command(
    settings: TrainSettings,
    paths: TrainPaths,
    device: TrainDevice,
    *,
    target_layer_ids: Sequence[int],
    on_missing: str = "raise",
    trust_remote_code: bool,
    online: dict[str, Any] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The full trainer command line. ``train.extra_args`` come last, so they override what is set here."""
    if device.processes > 1:  # one rank per GPU, or per core on CPU (gloo): the same entry and flags
        launcher = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={device.processes}",
            "-m",
            TRAINER_ENTRY,
        ]
    else:
        launcher = [python, "-m", TRAINER_ENTRY]
    command = list(launcher)
    for dest, value in trainer_arguments(
        settings,
        paths,
        device,
        target_layer_ids=target_layer_ids,
        on_missing=on_missing,
        trust_remote_code=trust_remote_code,
        online=online,
    ).items():
        if isinstance(value, bool):
            if value:
                command.append(_flag(dest))
        elif isinstance(value, list):
            command += [_flag(dest), *(str(v) for v in value)]
        else:
            command += [_flag(dest), str(value)]
    return command + list(settings.extra_args)


def resolve_device(gpus: int, cuda_devices: int, cpu_processes: int, cpu_cores: int) -> TrainDevice:
    """CUDA with ``gpus`` processes when asked for and present; otherwise the CPU shim with ``cpu_processes``
    ranks (train.cpu_processes), each needing one of the ``cpu_cores`` this process may run on."""
    if gpus > 0 and cuda_devices == 0:
        log.warning("train.gpus=%d but no CUDA device is visible: training on CPU through the shim", gpus)
        return _cpu_device(cpu_processes, cpu_cores)
    if gpus == 0:
        return _cpu_device(cpu_processes, cpu_cores)
    if gpus > cuda_devices:
        raise StageError(
            f"train.gpus={gpus} but only {cuda_devices} CUDA device(s) are visible; lower train.gpus or request "
            "more GPUs (profiles/slurm reads train.gpus)"
        )
    return TrainDevice("cuda", gpus)


def _cpu_device(processes: int, cores: int) -> TrainDevice:
    if processes > cores:
        raise StageError(
            f"train.cpu_processes={processes} but this job may run on {cores} CPU core(s) (os.sched_getaffinity): "
            f"each trainer rank needs a core of its own, or the ranks take turns at every collective and a step "
            f"takes many times as long. Set train.cpu_processes to at most {cores}, or give the job more cores "
            "(taskset, SLURM --cpus-per-task)"
        )
    return TrainDevice("cpu", processes)
