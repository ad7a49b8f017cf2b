"""Parameters per token of a target and of its EAGLE-3 draft, from the target's config.json (its text section).

What a token passes through decides what its prefill costs on a compute-bound GPU: every weight it multiplies
(~2 FLOPs each), the embedding lookup excluded, lm_head included. Dense decoders (Llama, Qwen, Mistral: grouped-query
attention, gated MLP) and DeepSeek-V3-style mixtures of experts (DeepSeek-V3, Kimi-K2: MLA attention, the first
`first_k_dense_replace` layers dense, then shared experts + the top-k routed ones and the router) are counted; any
other layout is refused with what is missing. Attention's own score and value products (~4 x layers x hidden x
context per token) are left out: at the sequence lengths these pipelines train on (<= 8k) they are a few percent of
an 8B model's weights' work, and the costs measured on a GPU include them for the shape they were measured on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.checkpoint_size import draft_attention


def _need(text: Mapping[str, Any], *keys: str) -> list[int]:
    missing = [k for k in keys if text.get(k) is None]
    if missing:
        raise StageError(
            f"the target's config.json has no {missing} in its text section: the forecast counts a dense decoder "
            "(hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size) or a "
            "DeepSeek-V3-style MoE (n_routed_experts, num_experts_per_tok, moe_intermediate_size, kv_lora_rank, ...). "
            "Fix: give the forecast a config.json of one of those layouts (--target-config FILE)"
        )
    return [int(text[k]) for k in keys]


def _mlp(hidden: int, width: int) -> int:
    return 3 * hidden * width  # gate, up, down


def _dense_attention(text: Mapping[str, Any]) -> int:
    hidden, heads = _need(text, "hidden_size", "num_attention_heads")
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    return hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def _mla_attention(text: Mapping[str, Any]) -> int:
    hidden, heads, kv_lora, nope, rope, v = _need(
        text, "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"
    )
    q_lora = text.get("q_lora_rank")
    q = hidden * heads * (nope + rope) if q_lora is None else hidden * q_lora + q_lora * heads * (nope + rope)
    return q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden


def is_moe(text: Mapping[str, Any]) -> bool:
    return text.get("n_routed_experts") is not None


def active_params_per_token(text: Mapping[str, Any]) -> int:
    """Weights one token multiplies in a forward of the target (embedding lookup excluded, lm_head included)."""
    hidden, layers, vocab = _need(text, "hidden_size", "num_hidden_layers", "vocab_size")
    if not is_moe(text):
        (width,) = _need(text, "intermediate_size")
        return layers * (_dense_attention(text) + _mlp(hidden, width)) + hidden * vocab
    experts, top_k, moe_width, dense_width = _need(
        text, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size"
    )
    dense_layers = int(text.get("first_k_dense_replace") or 0)
    shared = int(text.get("n_shared_experts") or 0)
    moe_layer = _mla_attention(text) + hidden * experts + (top_k + shared) * _mlp(hidden, moe_width)
    dense_layer = _mla_attention(text) + _mlp(hidden, dense_width)
    return dense_layers * dense_layer + (layers - dense_layers) * moe_layer + hidden * vocab


def draft_params_per_token(text: Mapping[str, Any], draft_vocab_size: int) -> int:
    """Weights one token multiplies in a forward of speculators' EAGLE-3 draft of this target: the fc that folds the
    three captured states (3h -> h), one Llama decoder layer whose attention reads [embedding; hidden] (2h wide in
    q, k, v), the target's MLP width, and the draft vocabulary's lm_head."""
    hidden, _ = _need(text, "hidden_size", "num_attention_heads")
    heads, kv_heads, head_dim = draft_attention(text)  # speculators' resolution (MLA: head_dim is the rope part)
    width = int(text.get("intermediate_size") or 0)
    if not width:
        raise StageError("the target's config.json has no intermediate_size: the draft's MLP is sized from it")
    attention = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return 3 * hidden * hidden + attention + _mlp(hidden, width) + hidden * draft_vocab_size
