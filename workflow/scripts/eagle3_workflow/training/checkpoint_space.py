"""The disk the trainer's checkpoints take (issue #41): refuse before training when the checkpoint folder's file system
cannot hold them, and say "disk full" when the trainer dies writing one. Pure functions (the refusal and the
failure's sentences) and thin adapters that read the target's config.json and the file system
(``checkpoint_needs``, ``require_checkpoint_space``). What speculators writes, and its bytes: trainer.checkpoint_size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.disk import DISK_FULL_TEXT, FileSystemSpace, existing_ancestor, space_of
from eagle3_workflow.files.hidden_states import human_bytes
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.checkpoint_size import (
    TORCH_WRITE_FAILURE,
    checkpoint_bytes,
    draft_model_bytes,
    draft_tensors,
    folders_to_write,
)


@dataclasses.dataclass(frozen=True)
class CheckpointNeed:
    """What train_draft will still write on one file system: ``folders`` of ``per_checkpoint`` bytes each, and
    ``published`` bytes of the draft it publishes (draft/model.safetensors: a copy of the last checkpoint's weights),
    where draft/ is on this file system."""

    folders: Sequence[int]
    per_checkpoint: int
    published: int = 0

    @property
    def total(self) -> int:
        return len(self.folders) * self.per_checkpoint + self.published


def space_refusal(need: CheckpointNeed, space: FileSystemSpace, *, save_dir: Path, margin: float) -> str | None:
    """The refusal when the file system cannot hold what is left to write (x margin), else None."""
    if need.total == 0 or need.total * margin <= space.free:
        return None
    fits = int(max(0.0, space.free / margin - need.published) // need.per_checkpoint)
    published = f"the published draft's weights {human_bytes(need.published)} ({need.published} bytes)"
    checkpoints = (
        f"{len(need.folders)} epoch folder(s) still to write (epochs {list(need.folders)}) x "
        f"{human_bytes(need.per_checkpoint)} ({need.per_checkpoint} bytes: the draft in bf16 with its frozen "
        "embedding, and the optimizer's state)"
    )
    what = (
        f"the trainer's checkpoints: {checkpoints}{' + ' + published if need.published else ''}"
        if need.folders
        else f"the published draft (draft/model.safetensors, a copy of the last checkpoint's weights): {published}"
    )
    room = f": room for {fits} checkpoint(s)" if need.folders else ""
    return (
        f"not enough disk for {what} = {human_bytes(need.total)} "
        f"({need.total} bytes; x{margin} margin = {human_bytes(need.total * margin)}), but {space.mount_point} "
        f"(the file system holding {save_dir}) has {human_bytes(space.free)} free ({space.free} bytes, of "
        f"{human_bytes(space.total)}){room}. speculators keeps every saved epoch's checkpoint, so "
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


def checkpoint_needs(
    target: Path, save_dir: Path, publish_dir: Path, *, settings: Any, captured_layers: int
) -> list[tuple[Path, CheckpointNeed]]:
    """What train_draft will still write for this target and train settings, per file system: the checkpoints into
    ``save_dir``, the published draft into ``publish_dir`` (one entry when both are on one file system)."""
    from eagle3_workflow.reference.target_config import read_target_config, text_section

    text = text_section(read_target_config(target).raw)
    tensors = draft_tensors(text, draft_layers=settings.draft_layers, draft_vocab_size=settings.draft_vocab_size,
                            captured_layers=captured_layers)  # fmt: skip
    on_disk = {p.name for p in save_dir.iterdir() if p.is_dir() and not p.is_symlink()} if save_dir.is_dir() else set()
    folders = folders_to_write(settings.epochs, settings.checkpoint_freq, on_disk)
    per_checkpoint, published = checkpoint_bytes(tensors, settings.optimizer), draft_model_bytes(tensors)
    if same_file_system(save_dir, publish_dir):
        return [(save_dir, CheckpointNeed(folders, per_checkpoint, published))]
    return [
        (save_dir, CheckpointNeed(folders, per_checkpoint)),
        (publish_dir, CheckpointNeed([], per_checkpoint, published)),
    ]


def same_file_system(a: Path, b: Path) -> bool:
    return os.stat(existing_ancestor(a)).st_dev == os.stat(existing_ancestor(b)).st_dev


def require_checkpoint_space(need: CheckpointNeed, folder: Path, *, margin: float) -> FileSystemSpace:
    """StageError with the numbers and the fixes when the file system that will hold ``folder`` cannot hold ``need``
    (``folder`` need not exist yet: nothing is created before the trainer runs)."""
    space = space_of(folder)
    refusal = space_refusal(need, space, save_dir=folder, margin=margin)
    if refusal is not None:
        raise StageError(refusal)
    return space
