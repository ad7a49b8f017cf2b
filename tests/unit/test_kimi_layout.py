"""The Kimi-K2.5 stand-in (target.build.kind kimi_k25) has the released checkpoint's layout, key for key and name for
name, in both variants: so it cannot drift into a layout no real checkpoint has (transformers' save_pretrained, for
one, writes ``language_model.model.blocks.N`` and ``Kimi_K25ForConditionalGeneration``). The release's layout below
is moonshotai/Kimi-K2.5's config.json and weight list, as vLLM's kimi_k25 / deepseek_v2 loaders read them. Served
for real: tests/integration/test_kimi_stand_in.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3_workflow.canary.slice import build_truncated_target
from eagle3_workflow.target_config import read_target_config, weight_files

LM = r"language_model\.model\.layers\.\d+\."
# every tensor of the release, as a pattern; EXPERT: a routed expert's projection (its suffix differs by variant)
RELEASE_TEXT = [
    r"language_model\.model\.embed_tokens\.weight",
    r"language_model\.model\.norm\.weight",
    r"language_model\.lm_head\.weight",
    LM + r"(input|post_attention)_layernorm\.weight",
    LM + r"self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|kv_b_proj|o_proj)\.weight",
    r"language_model\.model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight",  # the one dense layer
    LM + r"mlp\.gate\.(weight|e_score_correction_bias)",
    LM + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight",
]
EXPERT = LM + r"mlp\.experts\.\d+\.(gate|up|down)_proj\."
RELEASE_VISION = [
    r"vision_tower\.patch_embed\.proj\.(weight|bias)",
    r"vision_tower\.patch_embed\.pos_emb\.weight",
    r"vision_tower\.encoder\.blocks\.\d+\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\.(weight|bias)",
    r"vision_tower\.encoder\.final_layernorm\.(weight|bias)",
    r"mm_projector\.pre_norm\.(weight|bias)",
    r"mm_projector\.proj\.[02]\.(weight|bias)",
]
RELEASE_TOP_KEYS = {
    "architectures", "bos_token_id", "dtype", "eos_token_id", "ignore_index", "media_placeholder_token_id",
    "model_type", "pad_token_id", "text_config", "tie_word_embeddings", "use_unified_vision_chunk",
    "video_placeholder", "vision_config",
}  # fmt: skip
RELEASE_VISION_KEYS = {
    "init_pos_emb_height", "init_pos_emb_time", "init_pos_emb_width", "merge_kernel_size", "merge_type",
    "mm_hidden_size", "mm_projector_type", "patch_size", "pos_emb_type", "projector_hidden_act", "projector_ln_eps",
    "text_hidden_size", "video_attn_type", "vt_hidden_size", "vt_intermediate_size", "vt_num_attention_heads",
    "vt_num_hidden_layers",
}  # fmt: skip
RELEASE_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
RELEASE_MEDIA_PROC = {
    "fixed_output_tokens", "image_mean", "image_std", "in_patch_limit", "in_patch_limit_each_frame",
    "in_patch_limit_video", "max_num_frames_each_video", "merge_kernel_size", "patch_limit_on_one_side", "patch_size",
    "sample_fps", "temporal_merge_kernel_size", "timestamp_mode",
}  # fmt: skip


def tensors_of(target: Path) -> dict[str, torch.Tensor]:
    files = weight_files(target)
    out = {}
    for file in sorted(set(files.values())):
        with safe_open(str(target / file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    assert set(out) == set(files), "the index and the shards disagree"
    return out


def config_of(target: Path) -> dict:
    return json.loads((target / "config.json").read_text())


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_config_is_the_releases(kimi_stand_ins, quantization):
    config = config_of(kimi_stand_ins(quantization))
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25"
    # image_token_id: not a release key; transformers' native config would default it to the release vocabulary's
    assert set(config) - {"image_token_id"} == RELEASE_TOP_KEYS
    assert "quantization_config" not in config, "the release keeps quantization_config inside text_config"
    assert config["tie_word_embeddings"] is False
    assert RELEASE_VISION_KEYS <= set(config["vision_config"])
    text = config["text_config"]
    assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (512, 64)  # MLA as released (and vLLM-CPU's need)
    assert (text["scoring_func"], text["topk_method"], text["first_k_dense_replace"]) == ("sigmoid", "noaux_tc", 1)
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["n_shared_experts"]) == (8, 2, 1)
    assert text["num_hidden_layers"] == 8 and text["hidden_size"] >= 128
    media = json.loads((kimi_stand_ins(quantization) / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert set(media) == RELEASE_MEDIA_PROC
    if quantization == "none":
        assert "quantization_config" not in text
        return
    quant = text["quantization_config"]
    assert (quant["quant_method"], quant["format"], quant["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", "compressed"
    )  # fmt: skip
    assert quant["ignore"] == RELEASE_IGNORE
    (group,) = quant["config_groups"].values()
    weights = group["weights"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "int", True)
    assert (weights["strategy"], weights["group_size"]) == ("group", 32)
    assert group["targets"] == ["Linear"] and group["input_activations"] is None


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_tensor_names_are_the_releases(kimi_stand_ins, quantization):
    tensors = tensors_of(kimi_stand_ins(quantization))
    suffixes = r"weight" if quantization == "none" else r"weight_(packed|scale|shape)"
    patterns = [*RELEASE_TEXT, EXPERT + suffixes, *RELEASE_VISION]
    unmatched = sorted(name for name in tensors if not any(re.fullmatch(p, name) for p in patterns))
    assert not unmatched, f"names no release has: {unmatched[:8]}"
    absent = [p for p in patterns if not any(re.fullmatch(p, name) for name in tensors)]
    assert not absent, f"release tensors missing: {absent}"
    layers = {int(m.group(1)) for name in tensors if (m := re.match(r"language_model\.model\.layers\.(\d+)\.", name))}
    assert layers == set(range(8))
    experts = {name for name in tensors if re.fullmatch(EXPERT + suffixes, name)}
    assert len(experts) == 7 * 8 * 3 * (1 if quantization == "none" else 3)  # 7 MoE layers, 8 experts, 3 projections
    assert tensors["language_model.model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    hidden, moe = 128, 64
    if quantization == "int4":
        prefix = "language_model.model.layers.1.mlp.experts.0."
        assert tensors[prefix + "gate_proj.weight_packed"].dtype == torch.int32
        assert tuple(tensors[prefix + "gate_proj.weight_packed"].shape) == (moe, hidden // 8)
        assert tensors[prefix + "gate_proj.weight_scale"].dtype == torch.bfloat16
        assert tuple(tensors[prefix + "gate_proj.weight_scale"].shape) == (moe, hidden // 32)
        assert tuple(tensors[prefix + "down_proj.weight_packed"].shape) == (hidden, moe // 8)
        assert tensors[prefix + "down_proj.weight_shape"].dtype == torch.int32
        assert tensors[prefix + "down_proj.weight_shape"].tolist() == [hidden, moe]
    plain = {name: t for name, t in tensors.items() if not re.fullmatch(EXPERT + suffixes, name)}
    assert {t.dtype for name, t in plain.items() if "e_score" not in name} == {torch.bfloat16}


def test_int4_experts_are_the_bf16_experts_packed_by_compressed_tensors(kimi_stand_ins):
    """Same seed, same random weights: every INT4 expert decompresses (compressed-tensors' own decompress) to its bf16
    twin within about half a quantization step, and packing the stack of experts equals packing each alone."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    from eagle3_workflow.compressed_weights import int4_group_scheme, pack_int4_group

    bf16, int4 = tensors_of(kimi_stand_ins("none")), tensors_of(kimi_stand_ins("int4"))
    scheme = int4_group_scheme(32)
    experts = sorted(name.removesuffix(".weight") for name in bf16 if re.fullmatch(EXPERT + "weight", name))
    for module in experts:
        state = {p: int4[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        state["weight_scale"] = state["weight_scale"].float()
        restored = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
        original = bf16[f"{module}.weight"].float()
        step = state["weight_scale"].repeat_interleave(32, dim=1)
        # half a step, and a little more where the bf16-rounded scale clamps a group's maximum (7.5 steps -> 7)
        assert bool(((restored - original).abs() <= 0.55 * step).all()), module
    one = "language_model.model.layers.3.mlp.experts.5.down_proj"
    alone = pack_int4_group(bf16[one + ".weight"], 32)
    assert torch.equal(alone["weight_packed"], int4[one + ".weight_packed"])
    assert torch.equal(alone["weight_scale"], int4[one + ".weight_scale"])
    for name, tensor in bf16.items():  # everything else: the very same tensors
        if not re.fullmatch(EXPERT + "weight", name):
            assert torch.equal(tensor, int4[name]), name


def test_transformers_reads_it_natively_at_its_tiny_size(kimi_stand_ins):
    """No remote code: transformers' Kimi_K25Config (which vLLM 0.32 uses) reads the stand-in, the tower tiny (not its
    1152 x 27 defaults), text_config as DeepSeek-V3; the tokenizer loads plainly and names the image token."""
    from transformers import AutoConfig, AutoTokenizer

    target = kimi_stand_ins("int4")
    config = AutoConfig.from_pretrained(target)
    assert type(config).__name__ == "Kimi_K25Config"
    assert type(config.text_config).__name__ == "DeepseekV3Config"
    assert (config.vision_config.hidden_size, config.vision_config.num_hidden_layers) == (64, 2)
    assert config.text_config.quantization_config["format"] == "pack-quantized"
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.convert_tokens_to_ids("<|media_pad|>") == config.image_token_id
    assert tokenizer.chat_template
    assert read_target_config(target).num_layers == 8


def test_canary_slice_keeps_the_layout(kimi_stand_ins, tmp_path):
    target = kimi_stand_ins("int4")
    build_truncated_target(target, tmp_path / "slice", 4)
    config = config_of(tmp_path / "slice")
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["text_config"]["num_hidden_layers"] == 4
    assert config["text_config"]["quantization_config"] == config_of(target)["text_config"]["quantization_config"]
    assert "quantization_config" not in config
    assert (tmp_path / "slice" / "preprocessor_config.json").read_text() == (
        target / "preprocessor_config.json"
    ).read_text()
    assert (tmp_path / "slice" / "tokenizer.json").exists()
    names = set(tensors_of(tmp_path / "slice"))
    whole = set(weight_files(target))
    kept = {n for n in whole if not re.match(LM, n) or int(n.split(".")[3]) < 4}
    assert names == kept
    assert any(n.startswith("vision_tower.encoder.blocks.1.") for n in names)
    assert "language_model.model.layers.3.mlp.experts.7.up_proj.weight_packed" in names
