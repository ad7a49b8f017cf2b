"""Stage `train_draft`: an EAGLE-3 draft trained by speculators' own trainer, resumable after a kill.

Layout of ``train_work/`` (kept across failures; Snakemake deletes only the declared ``draft/``):

- ``data/``: the data directory ``speculators train`` reads: symlinks to the prepared dataset's files,
  ``token_freq.pt`` and ``hidden_states -> <files_dir>``, plus the vocabulary mapping
  ``d2t-<size>.npy`` / ``t2d-<size>.npy`` (built once from the token frequencies, then only ever read);
- ``checkpoints/<epoch>/``: speculators' checkpoints, from which a rerun resumes;
- ``logs/trainer-attempt-<n>.log``: the trainer's full output, one file per launch;
- ``logs/metrics-attempt-<n>.jsonl``: the metric records of that launch, one JSON line each, written by the
  trainer's rank 0 (metrics.csv is built from these, so the steps of a killed attempt are not lost);
- ``fingerprint.json``: what the checkpoints were trained from. When an input changes, the checkpoints and the
  mapping belong to another run: the directory is cleared and training starts afresh (logged).

The trainer runs as a subprocess: ``python -m eagle3_workflow.trainer_entry`` (CPU or one GPU) or
``torch.distributed.run ... -m eagle3_workflow.trainer_entry`` (several GPUs). The entry runs speculators' own
``speculators train`` with a handler on its metric logger (``speculators.metrics``) that writes each metric
dict as a JSON line, and on CPU with the CPU shim's patches; the records are the same on every device.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.contracts import published_directory, read_json, write_json_atomic
from eagle3_workflow.errors import StageError
from eagle3_workflow.runtime.child import ChildProcess, first_traceback, traceback_span
from eagle3_workflow.trainer_entry import DEVICE_ENV, METRICS_ENV

log = logging.getLogger("eagle3.training")

# Files of a checkpoint that only serve resuming; the rest (config, weights, provenance) goes to draft/
RESUME_ONLY_FILES = {"optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json"}
# Train settings that may change between a kill and the rerun without invalidating the checkpoints
RESUME_NEUTRAL_SETTINGS = {"gpus", "num_workers", "runtime_minutes", "checkpoint_freq"}
TAIL_LINES = 40


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The config's ``train`` section (defaults as in the schema)."""

    gpus: int = 8
    draft_layers: int = 1
    ttt_steps: int = 3
    draft_vocab_size: int = 32000
    lr: float = 1e-4
    optimizer: str = "adamw"
    epochs: int = 10
    total_seq_len: int = 8192
    train_data_ratio: float = 0.95
    num_workers: int = 4
    seed: int = 0
    checkpoint_freq: float = 1.0
    runtime_minutes: int = 1440
    extra_args: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, train: dict[str, Any]) -> TrainSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in train.items() if k in names}
        if "extra_args" in values:
            values["extra_args"] = tuple(str(a) for a in values["extra_args"])
        return cls(**values)


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


@dataclasses.dataclass
class CheckpointInfo:
    epoch: int
    local_step: int
    global_step: int
    path: str


@dataclasses.dataclass
class TrainingSummary:
    """draft/training.json: how the draft in draft/ was made."""

    device: str
    processes: int
    command: list[str]
    attempts: int
    resumed_from: CheckpointInfo | None
    final_checkpoint: CheckpointInfo
    epochs: int
    steps: int
    wall_s: float  # this attempt, stage start to end
    target_layer_ids: list[int]
    draft_vocab_size: int
    vocab_mapping_sha256: dict[str, str]
    final_train_loss: float | None
    final_val_loss: float | None
    final_val_full_acc: list[float]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def trainer_arguments(
    settings: TrainSettings,
    paths: TrainPaths,
    device: TrainDevice,
    *,
    target_layer_ids: Sequence[int],
    on_missing: str = "raise",
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """speculators TrainConfig field -> value, in command-line order."""
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
    if device.kind == "cpu":
        # flex attention has no CPU backward; the fused loss needs Triton
        args["draft_attn_impl"] = "sdpa"
        args["loss_implementation"] = "eager"
    return args


# speculators TrainConfig fields (dest names) this stage sets, on any device; check_api verifies each exists
TRAINER_FIELDS_USED = list(
    trainer_arguments(
        TrainSettings(), TrainPaths.in_work_dir(Path("w"), Path("t"), 2), TrainDevice("cpu"), target_layer_ids=[]
    )
)


# speculators train with our metrics handler (and on CPU the shim); its arguments are speculators' own
TRAINER_ENTRY = "eagle3_workflow.trainer_entry"


def build_train_command(
    settings: TrainSettings,
    paths: TrainPaths,
    device: TrainDevice,
    *,
    target_layer_ids: Sequence[int],
    on_missing: str = "raise",
    trust_remote_code: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """The full trainer command line. ``train.extra_args`` come last, so they override what is set here."""
    if device.kind == "cuda" and device.processes > 1:
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
    ).items():
        if isinstance(value, bool):
            if value:
                command.append(_flag(dest))
        elif isinstance(value, list):
            command += [_flag(dest), *(str(v) for v in value)]
        else:
            command += [_flag(dest), str(value)]
    return command + list(settings.extra_args)


def resolve_device(gpus: int, cuda_devices: int) -> TrainDevice:
    """CUDA with ``gpus`` processes when asked for and present; otherwise the CPU shim."""
    if gpus > 0 and cuda_devices == 0:
        log.warning("train.gpus=%d but no CUDA device is visible: training on CPU through the shim", gpus)
        return TrainDevice("cpu", 1)
    if gpus == 0:
        return TrainDevice("cpu", 1)
    if gpus > cuda_devices:
        raise StageError(
            f"train.gpus={gpus} but only {cuda_devices} CUDA device(s) are visible; lower train.gpus or request "
            "more GPUs (profiles/slurm reads train.gpus)"
        )
    return TrainDevice("cuda", gpus)


# ---------------------------------------------------------------------------------------------------------------
# Metrics: speculators' metric logger records {"train": {...}, "profile": {...}, "epoch", "lr", "global_step"} per
# logged train step and {"val": {..._epoch}, "epoch"} per validation epoch; the trainer entry writes each as a
# JSON line {"step": ..., "metrics": <that dict>}.

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_WORKER_SIGNAL = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: ([\w .]+)")
_SIGNAL_NUMBERS = {s.value for s in signal.Signals}
_PROGRESS_RUN = re.compile(r"([\u2500-\u259f])\1{39,}")


def clean_trainer_line(line: str) -> str:
    """A trainer output line as worth reading: no colour codes, progress bars shortened."""
    return _PROGRESS_RUN.sub(lambda m: m.group(1) * 40, _ANSI.sub("", line).rstrip())


def read_metric_lines(path: Path) -> list[dict[str, Any]]:
    """The records of one attempt's metrics JSONL ([] when the attempt logged none). A kill can cut the last
    line short: an unreadable line is skipped with a warning."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            log.warning("skipping line %d of %s (cut short by a kill?): %r", number, path, exc)
    return records


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"loss": 1}} -> {"train/loss": 1}, as speculators' logger backends name the values."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}/")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _metric_column(key: str) -> str:
    for prefix in ("train/", "val/", "profile/"):
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    if key.endswith("_epoch"):
        key = key[: -len("_epoch")]
    return key.replace("/", "_")


def _column_order(columns: Iterable[str]) -> list[str]:
    head = ["attempt", "split", "epoch", "global_step", "loss"]

    def per_position(prefix: str) -> list[str]:
        found = [c for c in columns if re.fullmatch(rf"{prefix}_\d+", c)]
        return sorted(found, key=lambda c: int(c.rsplit("_", 1)[1]))

    ordered = [c for c in head if c in columns]
    for prefix in ("loss", "full_acc", "cond_acc"):
        ordered += per_position(prefix)
    ordered += sorted(c for c in columns if c.startswith("lr"))
    ordered += sorted(c for c in columns if c not in ordered)
    return ordered


def metric_row(attempt: int, record: dict[str, Any]) -> dict[str, Any] | None:
    """One metrics.csv row for a JSONL record, or None for a record that is neither a train step nor a
    validation epoch. A validation row's global_step is the record's step: the optimizer steps done when it ran."""
    flat = _flatten(record.get("metrics") or {})
    if any(k.startswith("train/") for k in flat) and "global_step" in flat:
        split, step = "train", flat["global_step"]
    elif any(k.startswith("val/") for k in flat) and "epoch" in flat:
        split, step = "val", record.get("step")
    else:
        return None
    row: dict[str, Any] = {"attempt": attempt, "split": split, "epoch": flat.get("epoch"), "global_step": step}
    for key, value in flat.items():
        if key in ("epoch", "global_step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key == "lr" or key.startswith(("lr/", "train/", "val/", "profile/")):
            row[_metric_column(key)] = float(value)
    return row


def metrics_table(attempts: Sequence[Sequence[dict[str, Any]]]):
    """One row per logged train step and per validation epoch, from each attempt's metric records, in order.

    Columns: attempt, split (train|val), epoch, global_step, loss, loss_<k>, full_acc_<k>, cond_acc_<k> (k = draft
    position, i.e. TTT step), lr, then the rest (error_records, profile timings). A rerun that resumed from a
    checkpoint repeats the steps after it: the last attempt's rows win, so the table follows the run that
    produced the final weights.
    """
    import pandas as pd

    rows = [
        row
        for attempt, records in enumerate(attempts, start=1)
        for record in records
        if (row := metric_row(attempt, record)) is not None
    ]
    if not rows:
        return pd.DataFrame(columns=["attempt", "split", "epoch", "global_step", "loss"])
    frame = pd.DataFrame(rows)
    frame["global_step"] = frame["global_step"].astype("Int64")
    frame["epoch"] = frame["epoch"].astype("Int64")
    train = frame[frame["split"] == "train"].drop_duplicates("global_step", keep="last")
    val = frame[frame["split"] == "val"].drop_duplicates("epoch", keep="last")
    frame = pd.concat([train, val]).sort_values(["epoch", "global_step", "split"], kind="stable")
    return frame[_column_order(frame.columns)].reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------
# The work directory: fingerprint, staging, vocab mapping, checkpoints


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def training_fingerprint(
    settings: TrainSettings,
    *,
    target: Path,
    prepared: Path,
    token_freq: Path,
    validation: Path,
    files_dir: Path,
    rows: int,
    target_layer_ids: Sequence[int],
) -> dict[str, Any]:
    """What the checkpoints depend on, cheap to compute at any scale.

    Content hashes of the small inputs (so an upstream rerun that reproduces the same data keeps the checkpoints),
    of a few hidden-state files (they change when the target's weights do, which are too large to hash), and the
    names and sizes of the target's weight files.
    """

    relevant = {k: v for k, v in dataclasses.asdict(settings).items() if k not in RESUME_NEUTRAL_SETTINGS}
    relevant["extra_args"] = list(settings.extra_args)
    config_path = target / "config.json"
    weights = sorted(p for p in target.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    samples = [files_dir / f"hs_{row}.safetensors" for row in sorted({0, 1, rows // 2, rows - 1}) if row >= 0]
    return {
        "settings": relevant,
        "target_layer_ids": list(target_layer_ids),
        "target_config_sha256": sha256_file(config_path) if config_path.exists() else None,
        "target_weight_files": {p.name: p.stat().st_size for p in weights},
        "prepared_sha256": {p.name: sha256_file(p) for p in sorted(prepared.iterdir()) if p.is_file()},
        "token_freq_sha256": sha256_file(token_freq),
        "validation_sha256": sha256_file(validation),
        "hidden_state_samples_sha256": {p.name: sha256_file(p) for p in samples if p.exists()},
        # speculators 0.9.0 has no __version__: the installed distribution's metadata says it
        "speculators_version": importlib.metadata.version("speculators"),
    }


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def reconcile_work_dir(work_dir: Path, fingerprint: dict[str, Any]) -> bool:
    """Keep ``work_dir`` when it was made from the same inputs, else clear it. True when it was kept."""
    marker = work_dir / "fingerprint.json"
    if marker.exists():
        try:
            previous = read_json(marker)
        except (OSError, json.JSONDecodeError) as exc:
            previous = {"unreadable": repr(exc)}
        if previous == fingerprint:
            return True
        log.warning(
            "train_work %s was made from other inputs (differs in: %s): clearing it, training starts from scratch",
            work_dir,
            ", ".join(_differences(previous, fingerprint)),
        )
        shutil.rmtree(work_dir)
    elif work_dir.exists() and any(work_dir.iterdir()):
        log.warning("train_work %s has no fingerprint.json: clearing it, training starts from scratch", work_dir)
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(marker, fingerprint)
    return False


def _relative_symlink(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target.resolve(), link.parent.resolve()))


def stage_training_data(data_dir: Path, *, prepared: Path, token_freq: Path, files_dir: Path) -> None:
    """The data directory speculators reads: the prepared dataset's files, token_freq.pt and hidden_states/.

    Symlinks only (relative, so the results tree can move); rebuilt each time, so a changed shard list never
    leaves a stale link. Regular files here (the vocab mapping) are kept.
    """
    if not files_dir.is_dir():
        raise StageError(f"hidden-state files directory {files_dir} does not exist; run extract_hidden_states first")
    data_dir.mkdir(parents=True, exist_ok=True)
    for entry in data_dir.iterdir():
        if entry.is_symlink():
            entry.unlink()
    for item in sorted(prepared.iterdir()):
        _relative_symlink(data_dir / item.name, item)
    _relative_symlink(data_dir / "token_freq.pt", token_freq)
    _relative_symlink(data_dir / "hidden_states", files_dir)


def target_vocab_size(target: Path, trust_remote_code: bool = False) -> int:
    from speculators.train.vocab_mapping import get_target_vocab_size

    return int(get_target_vocab_size(None, str(target), trust_remote_code=trust_remote_code))


def ensure_vocab_mapping(paths: TrainPaths, *, token_freq: Path, draft_vocab_size: int, vocab_size: int) -> bool:
    """Build d2t/t2d once with speculators' own function; afterwards only check them. True when built now."""
    import numpy as np
    import torch

    if paths.d2t.exists() and paths.t2d.exists():
        d2t, t2d = np.load(paths.d2t), np.load(paths.t2d)
        if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,) or int(t2d.sum()) != draft_vocab_size:
            raise StageError(
                f"the vocab mapping in {paths.data_dir} has d2t {d2t.shape}, t2d {t2d.shape} with {int(t2d.sum())} "
                f"selected, but draft_vocab_size={draft_vocab_size} and the target vocabulary has {vocab_size} "
                f"tokens; delete {paths.data_dir.parent} to start this training afresh"
            )
        return False
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if draft_vocab_size > vocab_size:
        raise StageError(
            f"train.draft_vocab_size={draft_vocab_size} exceeds the target vocabulary ({vocab_size} tokens); set it "
            f"to at most {vocab_size}"
        )
    frequencies = torch.load(token_freq, weights_only=True)
    if not isinstance(frequencies, dict) or not frequencies:
        raise StageError(f"{token_freq} holds no token frequencies ({type(frequencies).__name__}); rerun prepare_data")
    d2t, t2d = build_vocab_mappings_from_distribution(frequencies, draft_vocab_size, vocab_size)
    covered = sum(1 for t in frequencies if t < vocab_size and bool(t2d[t]))
    log.info(
        "vocab mapping: %d draft tokens cover %d of %d distinct assistant tokens (%.1f%% of assistant token "
        "occurrences)",
        draft_vocab_size,
        covered,
        len(frequencies),
        100.0 * sum(c for t, c in frequencies.items() if t < vocab_size and bool(t2d[t])) / sum(frequencies.values()),
    )
    for path, array in ((paths.d2t, d2t.numpy()), (paths.t2d, t2d.numpy())):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npy")
        os.close(fd)
        np.save(tmp, array)
        os.replace(tmp, path)
    return True


def _checkpoint_problem(directory: Path) -> str | None:
    """None if a numbered checkpoint directory is complete, else what is wrong (a kill can land mid-save)."""
    from safetensors import SafetensorError, safe_open

    state = directory / "training_state.json"  # written last by speculators' save
    for name in ("config.json", "model.safetensors", "optimizer_state_dict.pt"):
        if not (directory / name).exists():
            return f"no {name}"
    if not state.exists():
        return "no training_state.json (the save did not finish)"
    try:
        json.loads(state.read_text())
        with safe_open(directory / "model.safetensors", framework="pt") as handle:
            handle.keys()
        with zipfile.ZipFile(directory / "optimizer_state_dict.pt") as archive:
            archive.namelist()
    except (OSError, ValueError, zipfile.BadZipFile, SafetensorError) as exc:
        return f"unreadable: {exc!r}"
    return None


def _numbered_checkpoints(save_dir: Path) -> list[Path]:
    if not save_dir.is_dir():
        return []
    found = [d for d in save_dir.iterdir() if d.is_dir() and not d.is_symlink() and d.name.isdigit()]
    return sorted(found, key=lambda d: int(d.name))


def drop_incomplete_checkpoints(save_dir: Path) -> list[str]:
    """Remove numbered checkpoints a kill left half-written, newest first, so speculators resumes from the last
    complete one (it picks the highest number without checking). Returns what was removed and why."""
    removed = []
    for directory in reversed(_numbered_checkpoints(save_dir)):
        problem = _checkpoint_problem(directory)
        if problem is None:
            break
        log.warning("removing incomplete checkpoint %s: %s", directory, problem)
        shutil.rmtree(directory)
        removed.append(f"{directory.name}: {problem}")
    return removed


def latest_checkpoint(save_dir: Path) -> CheckpointInfo | None:
    for directory in reversed(_numbered_checkpoints(save_dir)):
        if _checkpoint_problem(directory) is None:
            state = json.loads((directory / "training_state.json").read_text())
            return CheckpointInfo(
                epoch=int(state.get("epoch", directory.name)),
                local_step=int(state.get("local_step", 0)),
                global_step=int(state.get("global_step", 0)),
                path=str(directory),
            )
    return None


# ---------------------------------------------------------------------------------------------------------------
# Running the trainer


def run_trainer(
    command: list[str], *, env: dict[str, str], attempt_log: Path, on_line: Callable[[str], None]
) -> tuple[int, list[str]]:
    """Run the trainer, streaming each output line to ``on_line`` and ``attempt_log``; returns (rc, kept lines).

    A stop signal to the stage stops the trainer's whole tree (runtime.stage's policy); the trainer's tree
    (torchrun ranks, DataLoader workers) dies with the stage even when the stage is SIGKILLed.
    """
    attempt_log.parent.mkdir(parents=True, exist_ok=True)
    attempt_log.write_text(f"# {' '.join(command)}\n", encoding="utf-8")
    child = ChildProcess(
        command,
        name="speculators train",
        env=env,
        log_path=attempt_log,
        on_line=on_line,
        clean=clean_trainer_line,
        head_lines=2000,  # a traceback is usually here (start-up) ...
        tail_lines=400,  # ... or here (a failure after hours)
        stop_grace_s=10.0,
    )
    with child:
        rc = child.wait()
    return rc, child.output()


def stop_signal(rc: int, lines: Sequence[str]) -> str | None:
    """The signal that stopped the trainer, if one did: the trainer's own, or one its DataLoader workers got
    (the trainer then exits 1 with the worker's traceback, which hides what happened)."""
    if rc < 0:
        return signal.Signals(-rc).name
    if rc - 128 in _SIGNAL_NUMBERS:  # a shell or launcher reporting "killed by signal N" as 128 + N
        return signal.Signals(rc - 128).name
    descriptions = {signal.strsignal(s): s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for line in lines:
        found = _WORKER_SIGNAL.search(line)
        description = found.group(1).strip().rstrip(".") if found else ""
        if description in descriptions:
            return descriptions[description]
    return None


def _shorten(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else f"{line[:limit]}... ({len(line) - limit} more characters)"


def trainer_failure(rc: int, command: list[str], lines: list[str], attempt_log: Path) -> StageError:
    """The failure as a person reads it: how it ended, the first traceback, and the lines around it."""
    if rc < 0:
        how = f"was killed by signal {signal.Signals(-rc).name}" + (" (out of memory?)" if rc == -9 else "")
    else:
        how = f"exited with code {rc}"
    span = traceback_span(lines)
    if span is None:
        context = f"(no Python traceback in its output)\nLast {TAIL_LINES} lines:\n" + "\n".join(
            _shorten(line) for line in lines[-TAIL_LINES:]
        )
    else:
        quoted = f"First traceback:\n{first_traceback(lines)}"
        after = [line for line in lines[span[1] :] if line.strip()]
        if len(after) <= 5:  # the traceback ended the run: what led to it is more useful than a repeat of it
            before = "\n".join(_shorten(line) for line in lines[max(0, span[0] - 15) : span[0]])
            context = f"Before it:\n{before}\n{quoted}" + ("\nAfter it:\n" + "\n".join(after) if after else "")
        else:
            context = f"{quoted}\nLast {TAIL_LINES} lines:\n" + "\n".join(
                _shorten(line) for line in lines[-TAIL_LINES:]
            )
    return StageError(
        f"speculators train {how}.\ncommand: {' '.join(command)}\n{context}\n"
        f"Full output: {attempt_log}. Checkpoints written so far stay in {attempt_log.parent.parent / 'checkpoints'} "
        "and the rerun resumes from the last complete one."
    )


def trainer_env(device: TrainDevice, cpu_threads: int | None) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    env = child_environment()
    env.pop("FORCE_COLOR", None)
    env.pop(DEVICE_ENV, None)
    if device.kind == "cpu":
        env[DEVICE_ENV] = "cpu"  # the trainer entry applies the CPU shim
        if cpu_threads and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(cpu_threads)
    return env


def attempt_files(logs_dir: Path, attempt: int) -> tuple[Path, Path]:
    """(trainer output log, metrics JSONL) of one launch."""
    return logs_dir / f"trainer-attempt-{attempt:02d}.log", logs_dir / f"metrics-attempt-{attempt:02d}.jsonl"


def attempt_metrics(logs_dir: Path) -> list[list[dict[str, Any]]]:
    """The metric records of every launch so far, in order (an attempt killed before its first step has none)."""
    launches = len(list(logs_dir.glob("trainer-attempt-*.log")))
    return [read_metric_lines(attempt_files(logs_dir, n)[1]) for n in range(1, launches + 1)]


# ---------------------------------------------------------------------------------------------------------------
# The stage


def _check_inputs(
    settings: TrainSettings,
    *,
    prepared: Path,
    files_dir: Path,
    api_compat: dict[str, Any],
    validation: dict[str, Any],
) -> tuple[list[int], str, int]:
    """Target layer ids, the on-missing policy and the number of rows, or StageError naming what to fix."""
    import datasets

    layer_ids = [int(i) for i in api_compat.get("layer_ids") or []]
    if len(layer_ids) < 2:
        raise StageError(f"api_compat.json lists layer_ids {layer_ids}: need the draft's ids plus the verifier's last")
    target_layer_ids = layer_ids[:-1]
    if len(set(target_layer_ids)) != len(target_layer_ids):
        raise StageError(
            f"target layer ids {target_layer_ids} (api_compat layer_ids minus the last) contain duplicates; "
            "set hidden_states.layer_ids to distinct ids"
        )
    if validation.get("passed") is False:
        raise StageError("hidden_states/validation.json says the hidden states did not pass validation")
    layer_count = validation.get("layer_count")
    if layer_count is not None and int(layer_count) != len(layer_ids):
        raise StageError(
            f"the hidden-state files hold {layer_count} layers but api_compat.json lists {len(layer_ids)} layer ids "
            f"{layer_ids}; rerun extract_hidden_states with the current configuration"
        )
    rows = len(datasets.load_from_disk(str(prepared)))
    train_rows = int(rows * settings.train_data_ratio)
    if train_rows < 1 or train_rows >= rows:
        raise StageError(
            f"train.train_data_ratio={settings.train_data_ratio} splits {rows} prepared rows into {train_rows} for "
            f"training and {rows - train_rows} for validation; both need at least one row"
        )
    tolerated = list(validation.get("missing") or []) + list((validation.get("bad") or {}).keys())
    missing = [row for row in range(rows) if not (files_dir / f"hs_{row}.safetensors").exists()]
    if missing and not tolerated:
        raise StageError(
            f"{len(missing)} of {rows} hidden-state files are missing in {files_dir} (first rows: {missing[:10]}) "
            "although validation passed; rerun extract_hidden_states and validate_hidden_states"
        )
    # samples the validation tolerated (validation.max_bad_samples) are skipped with a warning, not fatal
    return target_layer_ids, "warn" if tolerated else "raise", rows


def _publish_draft(checkpoint: Path, out_dir: Path, metrics, summary: TrainingSummary) -> None:
    """Copy the final checkpoint (minus resume-only state) and the tables into out_dir, checked, all or nothing."""
    with published_directory(out_dir) as staging:
        for item in checkpoint.iterdir():
            if item.is_file() and item.name not in RESUME_ONLY_FILES:
                shutil.copy2(item, staging / item.name)
        metrics.to_csv(staging / "metrics.csv", index=False)
        write_json_atomic(staging / "training.json", summary)
        verify_draft(staging, draft_vocab_size=summary.draft_vocab_size, target_layer_ids=summary.target_layer_ids)


def verify_draft(out_dir: Path, *, draft_vocab_size: int, target_layer_ids: Sequence[int]) -> None:
    """The checkpoint is the EAGLE-3 draft vLLM expects (model type, vocab, layer ids), with finite weights."""
    import torch
    from safetensors import safe_open

    config = read_json(out_dir / "config.json")
    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, expected 'eagle3'")
    if config.get("draft_vocab_size") != draft_vocab_size:
        problems.append(f"draft_vocab_size is {config.get('draft_vocab_size')}, expected {draft_vocab_size}")
    if list(config.get("eagle_aux_hidden_state_layer_ids") or []) != list(target_layer_ids):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids is {config.get('eagle_aux_hidden_state_layer_ids')}, expected "
            f"{list(target_layer_ids)}"
        )
    with safe_open(out_dir / "model.safetensors", framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = handle.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problems.append(f"tensor {name} has non-finite values")
    if problems:
        raise StageError(f"the trained draft is not usable ({out_dir}): " + "; ".join(problems))


def _last(frame, split: str, column: str) -> float | None:
    rows = frame[frame["split"] == split]
    if column not in rows or rows[column].dropna().empty:
        return None
    return float(rows[column].dropna().iloc[-1])


def run_attempt(
    command: list[str],
    *,
    env: dict[str, str],
    logs_dir: Path,
    save_dir: Path,
    epochs: int,
    on_line: Callable[[str], None],
) -> CheckpointInfo:
    """One launch of the trainer, logged to its own file; the final checkpoint, or StageError saying why not."""
    attempt = len(list(logs_dir.glob("trainer-attempt-*.log"))) + 1
    attempt_log, metrics_jsonl = attempt_files(logs_dir, attempt)
    metrics_jsonl.unlink(missing_ok=True)  # left by a launch whose log was deleted: not this attempt's steps
    log.info("attempt %d (output also in %s): %s", attempt, attempt_log, " ".join(command))
    env = {**env, METRICS_ENV: str(metrics_jsonl)}
    rc, lines = run_trainer(command, env=env, attempt_log=attempt_log, on_line=on_line)
    stopped_by = stop_signal(rc, lines) if rc != 0 else None
    if stopped_by not in (None, "SIGKILL"):  # SIGKILL: more likely the OOM killer than a stop request
        final = latest_checkpoint(save_dir)
        raise StageError(
            f"speculators train was stopped by a signal ({stopped_by}); the rerun resumes from the last checkpoint "
            f"({final.path if final else 'none yet: it starts over'}). Output: {attempt_log}"
        )
    if rc != 0:
        raise trainer_failure(rc, command, lines, attempt_log)
    final = latest_checkpoint(save_dir)
    if final is not None and final.epoch == epochs - 1 and final.local_step == 0:
        return final
    if any("Training interrupted" in line for line in lines):
        raise StageError(
            f"speculators train was stopped by a signal (SIGTERM/SIGINT: a job time limit, scancel or Ctrl-C) and "
            f"saved {save_dir / 'interrupted'}, which it does not resume from. The rerun resumes from the last "
            f"complete checkpoint ({final.path if final else 'none yet'}); set train.checkpoint_freq below 1 to lose "
            "less of an epoch next time."
        )
    raise StageError(
        f"speculators train exited 0 but the last complete checkpoint in {save_dir} is "
        f"{final.path if final else None}, not the end of epoch {epochs - 1}; see {attempt_log}"
    )


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
    trust_remote_code: bool = False,
    cpu_threads: int | None = None,
    device: TrainDevice | None = None,
    on_line: Callable[[str], None] | None = None,
) -> TrainingSummary:
    """Train (or resume training) the draft in ``work_dir`` and publish it to ``out_dir``."""
    started = time.monotonic()
    target, prepared, token_freq = Path(target), Path(prepared), Path(token_freq)
    files_dir, work_dir, out_dir = Path(files_dir), Path(work_dir), Path(out_dir)
    if device is None:
        import torch

        device = resolve_device(settings.gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    target_layer_ids, on_missing, rows = _check_inputs(
        settings,
        prepared=prepared,
        files_dir=files_dir,
        api_compat=read_json(api_compat),
        validation=read_json(validation),
    )

    fingerprint = training_fingerprint(
        settings,
        target=target,
        prepared=prepared,
        token_freq=token_freq,
        validation=Path(validation),
        files_dir=files_dir,
        rows=rows,
        target_layer_ids=target_layer_ids,
    )
    kept = reconcile_work_dir(work_dir, fingerprint)
    paths = TrainPaths.in_work_dir(work_dir, target, settings.draft_vocab_size)
    stage_training_data(paths.data_dir, prepared=prepared, token_freq=token_freq, files_dir=files_dir)
    built = ensure_vocab_mapping(
        paths,
        token_freq=token_freq,
        draft_vocab_size=settings.draft_vocab_size,
        vocab_size=target_vocab_size(target, trust_remote_code),
    )
    mapping_sha = {"d2t": sha256_file(paths.d2t), "t2d": sha256_file(paths.t2d)}
    log.info(
        "vocab mapping %s (d2t %s, t2d %s)",
        "built" if built else "reused",
        mapping_sha["d2t"][:12],
        mapping_sha["t2d"][:12],
    )

    drop_incomplete_checkpoints(paths.save_dir)
    resumed_from = latest_checkpoint(paths.save_dir) if kept else None
    if resumed_from is not None:
        log.info(
            "resuming from checkpoint %s (epoch %d, global step %d)",
            resumed_from.path,
            resumed_from.epoch,
            resumed_from.global_step,
        )
    else:
        log.info("no checkpoint in %s: training from scratch", paths.save_dir)

    command = build_train_command(
        settings,
        paths,
        device,
        target_layer_ids=target_layer_ids,
        on_missing=on_missing,
        trust_remote_code=trust_remote_code,
    )
    logs_dir = work_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    log.info("training on %s with %d process(es)", device.kind, device.processes)
    if resumed_from is not None and resumed_from.epoch == settings.epochs - 1 and resumed_from.local_step == 0:
        # a forced rerun with the same inputs: the trainer would load the checkpoint and do nothing
        log.info(
            "all %d epochs are already trained in %s: publishing it without starting the trainer (delete %s to "
            "train again from scratch)",
            settings.epochs,
            resumed_from.path,
            work_dir,
        )
        final = resumed_from
    else:
        final = run_attempt(
            command,
            env=trainer_env(device, cpu_threads),
            logs_dir=logs_dir,
            save_dir=paths.save_dir,
            epochs=settings.epochs,
            on_line=on_line or (lambda line: log.info("| %s", line)),
        )
    attempts = attempt_metrics(logs_dir)
    metrics = metrics_table(attempts)
    train_rows = metrics[metrics["split"] == "train"]
    if train_rows.empty:
        raise StageError(
            f"no training metrics in {logs_dir}/metrics-attempt-*.jsonl: speculators logged no train step on its "
            f"'speculators.metrics' logger (did that logger or setup_metric_logger change? run check_api)"
        )
    final_loss = _last(metrics, "train", "loss")
    if final_loss is None or not math.isfinite(final_loss):
        raise StageError(f"the final training loss is {final_loss}; training diverged (see {logs_dir})")
    val_rows = metrics[metrics["split"] == "val"]
    full_acc = []
    if not val_rows.empty:
        last_val = val_rows.iloc[-1]
        full_acc = [float(last_val[c]) for c in metrics.columns if re.fullmatch(r"full_acc_\d+", c)]
    summary = TrainingSummary(
        device=device.kind,
        processes=device.processes,
        command=command,
        attempts=len(attempts),
        resumed_from=resumed_from,
        final_checkpoint=final,
        epochs=settings.epochs,
        steps=final.global_step,
        wall_s=round(time.monotonic() - started, 2),
        target_layer_ids=target_layer_ids,
        draft_vocab_size=settings.draft_vocab_size,
        vocab_mapping_sha256=mapping_sha,
        final_train_loss=final_loss,
        final_val_loss=_last(metrics, "val", "loss"),
        final_val_full_acc=full_acc,
    )
    _publish_draft(Path(final.path), out_dir, metrics, summary)
    log.info(
        "draft trained: %d steps in %d epoch(s), final train loss %.4f, val loss %s, full acc per position %s -> %s",
        final.global_step,
        settings.epochs,
        final_loss,
        summary.final_val_loss,
        [round(a, 3) for a in full_acc],
        out_dir,
    )
    return summary


def main(snakemake: Any) -> None:
    from eagle3_workflow.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        config = snakemake.params.settings
        settings = TrainSettings.from_config(config["train"])
        train_draft(
            settings,
            target=Path(snakemake.input.target),
            prepared=Path(snakemake.input.prepared),
            token_freq=Path(snakemake.input.token_freq),
            api_compat=Path(snakemake.input.api_compat),
            validation=Path(snakemake.input.validation),
            files_dir=Path(snakemake.params.files_dir),
            work_dir=Path(snakemake.params.work_dir),
            out_dir=Path(snakemake.output.draft),
            trust_remote_code=bool(config["target"]["trust_remote_code"]),
            cpu_threads=snakemake.threads,
        )

    run_stage("train_draft", snakemake.log[0], body, resumes="the rerun resumes from the last checkpoint")
