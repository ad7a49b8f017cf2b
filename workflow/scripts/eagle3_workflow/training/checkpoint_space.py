"""The disk the trainer's checkpoints take (issue #41): refuse before training when the checkpoint folder's file system
cannot hold them, and say "disk full" when the trainer dies writing one. Pure functions (the draft's tensors, the
bytes of one checkpoint, which epochs save one, the refusal and the failure's sentences) and thin adapters that read
the target's config.json and the file system (``require_checkpoint_space``, ``checkpoint_write_failure``).

What speculators 0.9.0 writes (``SingleGPUCheckpointer.save_checkpoint``, the distributed one writes the same from
rank 0), per saved epoch ``<save_dir>/<epoch>/``:

- ``model.safetensors``: every tensor of the draft's state dict but ``verifier_lm_head`` and ``verifier_norm``, in
  bf16 (``float_dtype``): the frozen embedding (verifier vocab x hidden: most of a small draft), the draft-vocab
  ``lm_head``, the fc, the decoder layers, the norms, and the vocab mapping buffers ``t2d`` (bool, verifier vocab)
  and ``d2t`` (int64, draft vocab);
- ``optimizer_state_dict.pt``: the optimizer's state cast to bf16: AdamW keeps two moments (exp_avg, exp_avg_sq) and
  a step for each parameter that received a gradient (the embedding and lm_head get none: the CPU checkpoint holds no
  state for them); Muon one momentum buffer per decoder matrix (AdamW's two for the rest);
- config.json, config.py, scheduler_state_dict.pt, training_state.json, train_command.txt, val_metrics.json: a few KB.

Nothing is deleted: every saved epoch's folder stays (``epoch<N>_end`` is a symlink to it; only ``--save-best``,
which this workflow does not pass, keeps the best alone), and a save with ``checkpoint_freq`` < 1 rewrites its
epoch's folder in place. So the run needs one checkpoint's bytes for each saved epoch whose folder is not on disk
yet. Measured: the tiny CPU draft's checkpoint (hidden 128, verifier vocab 1025, draft vocab 512) is 924,673 bytes
of tensors in model.safetensors and 1,052,186 of state in optimizer_state_dict.pt, the estimate's exact figures; its
files (config, scheduler, headers, zip records) add 23,090 bytes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.disk import DISK_FULL_TEXT, FileSystemSpace, space_of
from eagle3_workflow.files.hidden_states import human_bytes
from eagle3_workflow.settings.errors import StageError

BF16_BYTES = 2
# per checkpoint, beyond the tensors: the small files (23,090 bytes on the tiny CPU draft) and torch.save's zip records
# (~320 B a tensor there); 1 MiB covers drafts of many layers
FILES_OVERHEAD_BYTES = 1 << 20
# What a failed checkpoint write prints: torch.save's C++ stream (`basic_ios::clear: iostream error` from
# write_record, then `unexpected pos N vs M` from the zip writer's end: issue #41, a full disk on the H100), and
# any OSError ENOSPC/EDQUOT text (safetensors' writer, Python's own).
TORCH_WRITE_FAILURE = re.compile(r"basic_ios::clear: iostream error|PytorchStreamWriter failed|unexpected pos \d+ vs")


@dataclasses.dataclass(frozen=True)
class DraftTensors:
    """Element counts of the draft speculators builds, as its checkpoint stores them."""

    frozen: int  # saved, no optimizer state: the embedding and the draft-vocab lm_head
    trained_matrices: int  # fc and the decoder layers' projections
    trained_vectors: int  # the norms
    buffer_bytes: int  # t2d (bool, verifier vocab) + d2t (int64, draft vocab)
    parameters_with_state: int  # how many tensors carry optimizer state (a bf16 step each)


def draft_tensors(
    text: Mapping[str, Any], *, draft_layers: int, draft_vocab_size: int, captured_layers: int
) -> DraftTensors:
    """The draft speculators' trainer builds from a target's config.json text section (``create_transformer_layer
    _config``: a Llama decoder with the target's heads, kv heads, head_dim and intermediate size, 3 x hidden for a
    target without one) and its ``Eagle3DraftModel`` (fc from the ``captured_layers`` states, norm before it, a first
    layer whose attention reads [embedding; hidden], later layers plain)."""
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if text.get(k) is None]
    if missing:
        raise StageError(
            f"the target's config.json has no {missing} in its text section: the checkpoint disk check sizes the "
            "draft from hidden_size, num_attention_heads, vocab_size (and num_key_value_heads, head_dim, "
            "intermediate_size where given)"
        )
    hidden, heads, vocab = int(text["hidden_size"]), int(text["num_attention_heads"]), int(text["vocab_size"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = text.get("head_dim")
    if head_dim and hidden % heads != 0 and hidden % int(head_dim) == 0:  # speculators' own fallback
        heads = hidden // int(head_dim)
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    head_dim = int(head_dim or hidden // heads)
    width = int(text.get("intermediate_size") or 3 * hidden)
    q, kv, out = heads * head_dim, kv_heads * head_dim, heads * head_dim * hidden
    mlp = 3 * hidden * width
    first = 2 * hidden * (q + 2 * kv) + out + mlp
    later = hidden * (q + 2 * kv) + out + mlp
    matrices = captured_layers * hidden * hidden + first + (draft_layers - 1) * later
    vectors = captured_layers * hidden + 3 * hidden + 2 * hidden * (draft_layers - 1) + hidden
    return DraftTensors(
        frozen=vocab * hidden + draft_vocab_size * hidden,
        trained_matrices=matrices,
        trained_vectors=vectors,
        buffer_bytes=vocab + 8 * draft_vocab_size,
        # fc, input_norm, norm; a layer's q, k, v, o, 3 MLP, 2 norms (+ hidden_norm in the first)
        parameters_with_state=3 + 9 * draft_layers + 1,
    )


def checkpoint_bytes(tensors: DraftTensors, optimizer: str) -> int:
    """Bytes of one saved epoch: the model in bf16 plus the optimizer's state in bf16, plus the small files."""
    trained = tensors.trained_matrices + tensors.trained_vectors
    model = BF16_BYTES * (tensors.frozen + trained) + tensors.buffer_bytes
    if optimizer == "muon":  # one momentum buffer per matrix (Muon), AdamW's two for the vectors
        moments = tensors.trained_matrices + 2 * tensors.trained_vectors
    else:
        moments = 2 * trained
    state = BF16_BYTES * moments + BF16_BYTES * tensors.parameters_with_state
    return model + state + FILES_OVERHEAD_BYTES


def saved_epochs(epochs: int, checkpoint_freq: float) -> list[int]:
    """The epochs whose folder speculators writes (``Trainer.maybe_save_checkpoint``): every epoch below 1
    (mid-epoch saves rewrite the epoch's folder), else epoch 0 and each epoch e with (e + 1) % freq == 0."""
    if checkpoint_freq < 1:
        return list(range(epochs))
    return [e for e in range(epochs) if e == 0 or (e + 1) % checkpoint_freq == 0]


def folders_to_write(epochs: int, checkpoint_freq: float, on_disk: Collection[str]) -> list[int]:
    """The saved epochs whose folder is not in ``save_dir`` yet (a folder there is rewritten in place)."""
    return [e for e in saved_epochs(epochs, checkpoint_freq) if str(e) not in on_disk]


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
