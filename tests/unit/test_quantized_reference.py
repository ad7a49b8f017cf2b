"""The fp32 full-depth reference of a compressed-tensors checkpoint (eagle3_workflow.reference.compressed_weights and
full_depth_reference), against transformers' own decompressing load
(``from_pretrained(..., quantization_config=CompressedTensorsConfig(run_compressed=False))``):

- a Llama, every Linear but the head int4 (pack-quantized, symmetric, group 32): the streamed reference equals
  transformers' fp32 forward at every layer id 0..N and after the final norm;
- a DeepSeek-V3 (hidden 128, MLA, 8 routed experts, top-2) quantized as Kimi-K2.5 is (routed experts only, stored per
  expert: ``mlp.experts.E.{gate,up,down}_proj.weight_packed`` ...; Kimi's ignore list): transformers dequantizes the
  experts before fusing them (its DecompressExperts), in the scale's dtype, bf16. So the fused expert weights are
  compared exactly (ours, exact fp32 q * scale, rounded to bf16 == transformers'), every other weight exactly, and
  the hidden states at every id within what that bf16 rounding can move them;
- the same checkpoint in Kimi-K2.5's wrapper layout (``language_model.`` prefix, vision tensors, the config in
  ``text_config``, the quantization_config inside it) gives bit-identical states, and check_api's preflight names
  the scheme;
- schemes it does not read, and a config that does not describe its tensors, are refused with the cause and fix.
Checkpoints are built in tmp_path with compressed-tensors' own quantization (reference.compressed_weights.pack_int4_group).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hf_forward import hf_forward_states
from safetensors.torch import load_file, save_file

from eagle3_workflow.reference import compressed_weights as cw
from eagle3_workflow.reference.full_depth import (
    UnsupportedTarget,
    load_module,
    open_target,
    preflight,
    stream_reference,
)
from eagle3_workflow.reference.layer_match import POST_NORM
from eagle3_workflow.target_build.tiny import model_config

GROUP = 32
SAMPLES = [list(range(5, 45)), list(range(100, 109))]  # 40 and 9 tokens, one padded batch
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def saved_model(out: Path, arch: str, num_layers: int = 3) -> Path:
    """A random-weight bf16 model saved by transformers (DeepSeek's experts stored per expert, as on the Hub)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(
        arch, num_layers=num_layers, hidden_size=128, head_dim=64, vocab_size=300, bos=0, eos=1, pad=2
    )
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
    return out


def quantize(target: Path, quantized: re.Pattern, ignore: list[str]) -> int:
    """The checkpoint rewritten in place: every tensor `quantized` matches stored as pack-quantized int4 (group 32)
    by compressed-tensors, config.json given the matching quantization_config. Returns how many were quantized."""
    plain = load_file(target / "model.safetensors")
    stored: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in plain.items():
        if quantized.search(name):
            count += 1
            module = name.removesuffix(".weight")
            stored.update({f"{module}.{key}": t for key, t in cw.pack_int4_group(tensor.float(), GROUP).items()})
        else:
            stored[name] = tensor
    save_file(stored, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = cw.int4_group_config(GROUP, ignore)
    (target / "config.json").write_text(json.dumps(config))
    return count


def as_kimi_wrapper(flat: Path, out: Path) -> Path:
    """The quantized DeepSeek-V3 in Kimi-K2.5's layout: language model under ``language_model.``, a vision tower and
    projector beside it, the top config kimi_k25 with the language model (and its quantization_config) in
    text_config."""
    out.mkdir()
    tensors = {f"language_model.{name}": t for name, t in load_file(flat / "model.safetensors").items()}
    tensors["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(48, 16).to(torch.bfloat16)
    tensors["mm_projector.proj.0.weight"] = torch.randn(128, 16).to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((flat / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    text.pop("architectures", None)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {},
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def streamed(target: Path) -> dict[str, torch.Tensor]:
    states: dict[str, torch.Tensor] = {}
    stream_reference(
        target, SAMPLES, lambda label, s: states.__setitem__(label, s.clone()), trust_remote_code=False, device="cpu"
    )
    return states


def hf_decompressed(target: Path):
    """transformers' own load of the compressed checkpoint, dequantized at load (run_compressed=False), fp32."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()


def worst_errors(ours: dict[str, torch.Tensor], model) -> tuple[float, float]:
    """(max abs, max relative-to-the-state's-max) difference over every sample, token and depth."""
    worst_abs = worst_rel = 0.0
    for b, ids in enumerate(SAMPLES):
        for label, expected in hf_forward_states(model, ids).items():
            diff = (ours[label][b, : len(ids)] - expected).abs().max()
            worst_abs = max(worst_abs, float(diff))
            worst_rel = max(worst_rel, float(diff / expected.abs().max()))
    return worst_abs, worst_rel


# ---------------------------------------------------------------- against transformers' decompressing load


def test_quantized_llama_reference_equals_transformers_decompressed_forward(tmp_path):
    target = saved_model(tmp_path / "llama", "llama")
    from transformers import AutoModelForCausalLM

    plain_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # the bf16 weights
    assert quantize(target, LINEAR, ["lm_head"]) == 3 * 7
    ours = streamed(target)
    assert set(ours) == {"0", "1", "2", "3", POST_NORM}
    hf = hf_decompressed(target)
    worst_abs, worst_rel = worst_errors(ours, hf)
    assert worst_rel < 1e-5, f"streamed dequantized reference vs transformers: max abs {worst_abs}, rel {worst_rel}"
    _, quantization_effect = worst_errors(ours, plain_model)
    assert quantization_effect > 100 * max(worst_rel, 1e-7), "the test must see the int4 weights, not the bf16 ones"


@pytest.fixture(scope="module")
def quantized_deepseek(tmp_path_factory) -> Path:
    target = saved_model(tmp_path_factory.mktemp("ds") / "deepseek", "deepseek_v3")
    assert quantize(target, EXPERT, KIMI_IGNORE) == 2 * 8 * 3, "layers 1 and 2 (layer 0 is dense): 8 experts x 3"
    return target


def test_quantized_deepseek_experts_equal_transformers_dequantized_experts(quantized_deepseek):
    hf = hf_decompressed(quantized_deepseek)
    target = open_target(quantized_deepseek, trust_remote_code=False)
    from eagle3_workflow.reference.full_depth import split_by_layer

    _, per_layer = split_by_layer(target.names(), len(target.decoder.layers))
    for index in (1, 2):
        layer = target.decoder.layers[index]
        load_module(target.model, layer, target.read(quantized_deepseek, per_layer[index]), f"layer {index}")
        theirs = dict(hf.model.layers[index].named_parameters())
        for name, ours in layer.named_parameters():
            expected = theirs[name]
            if ".experts." in f".{name}":
                assert expected.dtype == torch.bfloat16, "transformers dequantizes the experts in bf16 (the scale's)"
                assert torch.equal(ours.to(torch.bfloat16), expected), f"layer {index} {name}"
            else:
                assert torch.equal(ours, expected.float()), f"layer {index} {name}"


def test_quantized_deepseek_reference_agrees_with_transformers_at_every_layer_id(quantized_deepseek):
    ours = streamed(quantized_deepseek)
    assert set(ours) == {"0", "1", "2", "3", POST_NORM}
    hf = hf_decompressed(quantized_deepseek).float()  # its bf16-dequantized experts widened to fp32
    worst_abs, worst_rel = worst_errors(ours, hf)
    # the only difference: transformers rounds each expert weight q * scale to bf16 (2^-9 relative)
    assert worst_rel < 2e-3, f"streamed dequantized reference vs transformers: max abs {worst_abs}, rel {worst_rel}"


def test_kimi_wrapper_layout_gives_the_same_states_and_names_the_scheme(quantized_deepseek, tmp_path):
    wrapper = as_kimi_wrapper(quantized_deepseek, tmp_path / "kimi")
    flat, wrapped = streamed(quantized_deepseek), streamed(wrapper)
    assert set(wrapped) == set(flat)
    for label, states in flat.items():
        assert torch.equal(wrapped[label], states), label
    found = preflight(wrapper, trust_remote_code=False)
    assert "DeepseekV3ForCausalLM (the text model, tensors under 'language_model.')" in found
    assert "compressed-tensors pack-quantized int4 symmetric group 32 (routed experts; 4 ignore patterns" in found
    assert "in config.json's text_config" in found
    assert "plain weights (not quantized)" in preflight(
        saved_model(tmp_path / "plain", "llama", 2), trust_remote_code=False
    )


# ---------------------------------------------------------------- the library's own arithmetic, formats refused


def test_pack_int4_group_is_the_library_quantization():
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    weight = torch.randn(64, 128)
    packed = cw.pack_int4_group(weight, GROUP)
    assert packed["weight_packed"].dtype == torch.int32 and tuple(packed["weight_packed"].shape) == (64, 16)
    assert packed["weight_scale"].dtype == torch.bfloat16 and tuple(packed["weight_scale"].shape) == (64, 4)
    assert packed["weight_shape"].tolist() == [64, 128]
    scheme = cw.read_scheme({"quantization_config": cw.int4_group_config(GROUP, [])})
    ours = cw.dequantize({f"e.{k}": v for k, v in packed.items()}, scheme)["e.weight"]
    args = cw.int4_group_scheme(GROUP).weights
    expected = fake_quantize(weight, packed["weight_scale"].float(), torch.zeros_like(packed["weight_scale"]), args)
    assert torch.equal(ours, expected)
    # round to nearest on the grid [-8, 7] x scale: at most half a step off, wherever weight / scale <= 7.5. Above
    # that lies only a group's largest positive weight, and only because the scale (calculate_qparams' absmax / 7.5)
    # was rounded down to bf16 (relative error <= 2^-8): it is at most 7.5 / (1 - 2^-8) steps up, clamped to 7
    # (half a step was the bound here until a random weight on CI, 2026-12-08, landed 0.5037 steps off)
    scale = packed["weight_scale"].float().repeat_interleave(GROUP, dim=1)
    error, steps = (ours - weight).abs(), weight / scale
    inside = steps <= 7.5
    assert 0 < float(error.max())
    assert bool((error[inside] <= scale[inside] / 2 + 1e-6).all())
    assert bool((error[~inside] <= scale[~inside] * (7.5 / (1 - 2**-8) - 7) + 1e-6).all())
    assert bool((steps[~inside] <= 7.5 / (1 - 2**-8) + 1e-6).all())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "float-quantized"}, "format 'float-quantized' is not read"),
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not compressed-tensors"),
        ({"group": {"actorder": "group"}}, "actorder"),
    ],
)
def test_a_scheme_it_does_not_read_is_refused_with_the_fix(tmp_path, change, message):
    target = saved_model(tmp_path / "m", "llama", 2)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = cw.int4_group_config(GROUP, ["lm_head"])
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(change.pop("group", {}))
    config["quantization_config"].update(change)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedTarget) as info:
        preflight(target, trust_remote_code=False)
    assert message in str(info.value) and "the checkpoint is quantized" in str(info.value)
    assert "Fix: point target.path at a bf16 copy" in str(
        info.value
    ) and "reads compressed-tensors pack-quantized" in str(info.value)


def test_packed_tensors_no_config_group_claims_are_refused(tmp_path):
    target = saved_model(tmp_path / "m", "llama", 2)
    quantize(target, LINEAR, ["lm_head", "re:.*o_proj$"])  # the config says o_proj is plain; it is stored packed
    with pytest.raises(UnsupportedTarget, match=r"self_attn\.o_proj\.weight_packed.*no config group"):
        preflight(target, trust_remote_code=False)
