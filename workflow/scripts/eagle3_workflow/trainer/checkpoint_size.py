"""The bytes of the checkpoints speculators' trainer writes, from the target's config.json alone (pure): the draft's
tensors, one checkpoint's bytes, which epochs save one. training.checkpoint_space refuses a run the disk cannot
hold with it; the forecast sizes train_draft's disk with it.

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
from collections.abc import Collection, Mapping
from typing import Any

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
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    heads, kv_heads, head_dim = draft_attention(text)
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


def draft_attention(text: Mapping[str, Any]) -> tuple[int, int, int]:
    """(heads, kv heads, head_dim) of the draft's attention, as ``create_transformer_layer_config`` resolves them
    from the target's config: its heads and kv heads, head_dim where given, else hidden / heads; where hidden is no
    multiple of heads, hidden / head_dim heads. MLA targets (DeepSeek-V2/V3, Kimi-K2): transformers' config sets
    head_dim to qk_rope_head_dim whatever config.json says, and speculators reads that attribute (the real-width
    Kimi stand-in's draft: 64 heads of 64, not of hidden / heads = 112)."""
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = text.get("qk_rope_head_dim") or text.get("head_dim")
    if head_dim and hidden % heads != 0 and hidden % int(head_dim) == 0:  # speculators' own fallback
        heads = hidden // int(head_dim)
        kv_heads = kv_heads if heads % kv_heads == 0 else heads
    return heads, kv_heads, int(head_dim or hidden // heads)


def draft_model_bytes(tensors: DraftTensors) -> int:
    """The tensors of a checkpoint's model.safetensors: the draft in bf16, its frozen embedding included, and the
    vocab mapping buffers. train_draft publishes one more copy of them (draft/model.safetensors)."""
    return BF16_BYTES * (tensors.frozen + tensors.trained_matrices + tensors.trained_vectors) + tensors.buffer_bytes


def checkpoint_bytes(tensors: DraftTensors, optimizer: str) -> int:
    """Bytes of one saved epoch: the model in bf16 plus the optimizer's state in bf16, plus the small files."""
    trained = tensors.trained_matrices + tensors.trained_vectors
    model = draft_model_bytes(tensors)
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
