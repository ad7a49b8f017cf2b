"""The disk the trainer's checkpoints take (issue #41): refuse before training when the checkpoint folder's file system
cannot hold them, and say "disk full" when the trainer dies writing one. Pure functions (the refusal and the
failure's sentences) and thin adapters that read the target's config.json and the file system
(``checkpoint_need``, ``require_checkpoint_space``). What speculators writes, and its bytes: trainer.checkpoint_size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.disk import DISK_FULL_TEXT, FileSystemSpace, space_of
from eagle3_workflow.files.hidden_states import human_bytes
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.checkpoint_size import (
    TORCH_WRITE_FAILURE,
    checkpoint_bytes,
    draft_tensors,
    folders_to_write,
)


@dataclasses.dataclass(frozen=True)
class CheckpointNeed:
    """What the trainer will still write: ``folders`` of ``per_checkpoint`` bytes each."""

    folders: Sequence[int]
    per_checkpoint: int

    @property
    def total(self) -> int:
        return len(self.folders) * self.per_checkpoint


def space_refusal(need: CheckpointNeed, space: FileSystemSpace, *, save_dir: Path, margin: float) -> str | None:
    """The refusal when the file system cannot hold what is left to write (x margin), else None."""
    if not need.folders or need.total * margin <= space.free:
        return None
    fits = int(space.free // (need.per_checkpoint * margin))
    return (
        f"not enough disk for the trainer's checkpoints: {len(need.folders)} epoch folder(s) still to write "
        f"(epochs {list(need.folders)}) x {human_bytes(need.per_checkpoint)} ({need.per_checkpoint} bytes: the draft "
        f"in bf16 with its frozen embedding, and the optimizer's state) = {human_bytes(need.total)} "
        f"({need.total} bytes; x{margin} margin = {human_bytes(need.total * margin)}), but {space.mount_point} "
        f"(the file system holding {save_dir}) has {human_bytes(space.free)} free ({space.free} bytes, of "
        f"{human_bytes(space.total)}): room for {fits}. speculators keeps every saved epoch's checkpoint, so "
        "the run would die writing one after hours of training. Fix: free space on that file system, or move the "
        "run's results folder to a larger disk (leave a symlink in its place), or save fewer epochs "
        "(train.checkpoint_freq N saves epoch 0 and every N-th; keep train.epochs a multiple of N so the last is "
        "saved), or train fewer epochs (train.epochs); lower train.disk_margin only if you know the estimate is "
        "pessimistic."
    )


def checkpoint_write_failure(lines: Sequence[str]) -> str | None:
    """The first line of the trainer's output that says a write failed (a full disk, an exceeded quota, or
    torch.save's stream error, which is what a full disk looks like there), else None."""
    return next(
        (line.strip() for line in lines if DISK_FULL_TEXT.search(line) or TORCH_WRITE_FAILURE.search(line)),
        None,
    )


def write_failure_sentence(line: str, space: FileSystemSpace, *, save_dir: Path, per_checkpoint: int | None) -> str:
    """The cause and the fix of a trainer that died on a failed write (a checkpoint: torch.save; its metric log): "disk
    full" when the output says so or the checkpoints' file system has less free now than one checkpoint takes."""
    full = DISK_FULL_TEXT.search(line) is not None or (per_checkpoint is not None and space.free < per_checkpoint)
    one = f"; one checkpoint of this draft takes about {human_bytes(per_checkpoint)}" if per_checkpoint else ""
    cause = (
        "disk full: the trainer died when a write failed"
        if full
        else "the trainer died when a write failed (a full disk at that moment, since freed, or a failing disk)"
    )
    return (
        f"{cause}: {line}\n{space.mount_point} (the file system holding {save_dir}) has "
        f"{human_bytes(space.free)} free now ({space.free} bytes, of {human_bytes(space.total)}){one}.\n"
        f"Fix: free space on {space.mount_point} or move the run's results folder to a larger disk, then rerun the "
        "same command: it resumes from the newest complete checkpoint and removes the half-written one."
    )


# ------------------------------------------------------------------------------------------------------ adapters


def checkpoint_need(target: Path, save_dir: Path, *, settings: Any, captured_layers: int) -> CheckpointNeed:
    """What the trainer will still write into ``save_dir`` for this target and train settings."""
    from eagle3_workflow.reference.target_config import read_target_config, text_section

    text = text_section(read_target_config(target).raw)
    tensors = draft_tensors(text, draft_layers=settings.draft_layers, draft_vocab_size=settings.draft_vocab_size,
                            captured_layers=captured_layers)  # fmt: skip
    on_disk = {p.name for p in save_dir.iterdir() if p.is_dir() and not p.is_symlink()} if save_dir.is_dir() else set()
    return CheckpointNeed(
        folders_to_write(settings.epochs, settings.checkpoint_freq, on_disk),
        checkpoint_bytes(tensors, settings.optimizer),
    )


def require_checkpoint_space(need: CheckpointNeed, save_dir: Path, *, margin: float) -> FileSystemSpace:
    """StageError with the numbers and the fixes when ``save_dir``'s file system cannot hold ``need``."""
    save_dir.mkdir(parents=True, exist_ok=True)
    space = space_of(save_dir)
    refusal = space_refusal(need, space, save_dir=save_dir, margin=margin)
    if refusal is not None:
        raise StageError(refusal)
    return space
