"""The gates without a server: check_api passes on healthy tiny targets (llama, qwen3, deepseek_v3) and names
every broken surface; the canary's pure parts (layer count and ids, slot matching, truncation). The canary through
the production server and the gates through Snakemake: tests/integration/test_gates_canary.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import api_report

from eagle3_workflow.canary.slice import (
    canary_layer_count,
    canary_layer_ids,
    id_set_shape_problems,
    keep_tensor,
    truncated_config,
)

ARCHS = ["llama", "qwen3", "deepseek_v3"]


def failed_rows(report) -> dict[str, str]:
    return {row.name: row.found for row in report.checks if not row.passed}


# ---------------------------------------------------------------- check_api


@pytest.mark.parametrize("arch", ARCHS)
def test_check_api_passes_on_healthy_targets(tiny_targets, arch):
    report = api_report(tiny_targets(arch))
    assert report.passed, failed_rows(report)
    assert report.layer_ids == [2, 4, 5, 8]


@pytest.mark.parametrize("arch", ARCHS)
def test_check_api_rejects_layer_ids_out_of_range(tiny_targets, arch):
    report = api_report(tiny_targets(arch), configured_layer_ids=[2, 3, 9])
    assert not report.passed
    assert "outside 1..8" in failed_rows(report)["layer ids"]


def test_check_api_catches_a_missing_trainer_interrupt_patch_point(tiny_targets, monkeypatch):
    """The trainer entry wraps these on every device so that a stop signal's save can be resumed from."""
    from speculators.train import trainer

    monkeypatch.delattr(trainer.Trainer, "_optimizers_step")
    found = failed_rows(api_report(tiny_targets("llama")))["trainer interrupt patch points"]
    assert "speculators.train.trainer:Trainer._optimizers_step" in found


def test_check_api_rejects_unordered_layer_ids(tiny_targets):
    report = api_report(tiny_targets("llama"), configured_layer_ids=[3, 2, 4])
    assert "increasing order" in failed_rows(report)["layer ids"]


@pytest.mark.parametrize("arch", ARCHS)
def test_check_api_catches_a_missing_connector_method(tiny_targets, arch, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as module

    monkeypatch.delattr(module.ExampleHiddenStatesConnector, "_submit_async_write")
    report = api_report(tiny_targets(arch))
    failed = failed_rows(report)
    assert "connector write hook signature" in failed
    assert "CPU connector internals" in failed


def test_check_api_catches_a_moved_cpu_server_patch_point(tiny_targets, monkeypatch):
    """The CPU server's launcher (its EngineCore forked) patches CpuPlatform.check_and_update_config: a vLLM where it
    is no longer a classmethod of (cls, vllm_config) fails the gate, naming the row and the fix."""
    from vllm.platforms import cpu

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", staticmethod(lambda config: None))
    found = failed_rows(api_report(tiny_targets("llama")))["CPU server launcher patch points"]
    assert "no classmethod" in found


def test_check_api_catches_a_changed_signature(tiny_targets, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as module

    def renamed(kv_cache, slots, count):  # the parameter names the CPU connector passes are gone
        raise AssertionError("never called")

    monkeypatch.setattr(module, "extract_from_kv_cache", renamed)
    report = api_report(tiny_targets("qwen3"))
    assert "extract_from_kv_cache signature" in failed_rows(report)


def test_check_api_catches_a_missing_speculative_method(tiny_targets, monkeypatch):
    from typing import Literal

    from vllm.config import speculative

    monkeypatch.setattr(speculative, "SpeculativeMethod", Literal["ngram", "eagle", "eagle3"])
    report = api_report(tiny_targets("llama"))
    assert "speculative method extract_hidden_states" in failed_rows(report)


def test_check_api_catches_an_unsupported_architecture(tiny_targets, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    config = json.loads((tiny_targets("llama") / "config.json").read_text())
    config["architectures"] = ["NotARealModelForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((tiny_targets("llama") / name).read_bytes())
    report = api_report(target)
    assert "not in vLLM's model registry" in failed_rows(report)["target architecture"]


def test_check_api_refuses_a_target_the_full_depth_reference_cannot_run(tiny_targets, tmp_path):
    """A quantized checkpoint: validate_hidden_states could not prove it after extraction, so check_api says so
    before any server starts; turned off (unsafe), the row says it did not check."""
    target = tmp_path / "model"
    target.mkdir()
    for path in tiny_targets("llama").iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (target / "config.json").write_text(json.dumps(config))
    assert "quantized (compressed-tensors)" in failed_rows(api_report(target))["full-depth reference"]
    row = next(r for r in api_report(target, full_depth_check=False).checks if r.name == "full-depth reference")
    assert row.passed and "not checked" in row.found and "unsafe" in row.found


def test_check_api_catches_a_renamed_acceptance_counter(tiny_targets, monkeypatch):
    from eagle3_workflow.serving import engine

    monkeypatch.setattr(engine, "SPEC_COUNTERS", {**engine.SPEC_COUNTERS, "vllm:spec_decode_renamed": "x"})
    report = api_report(tiny_targets("llama"))
    assert "vllm:spec_decode_renamed" in failed_rows(report)["spec-decode metrics"]


# ---------------------------------------------------------------- canary: pure parts


def test_canary_layer_count_covers_layer_types():
    assert canary_layer_count({"num_hidden_layers": 32}, None) == 8
    assert canary_layer_count({"num_hidden_layers": 61, "first_k_dense_replace": 3}, None) == 8
    assert canary_layer_count({"num_hidden_layers": 61, "first_k_dense_replace": 10}, None) == 11
    types = ["sliding_attention"] * 11 + ["full_attention"] + ["sliding_attention"] * 6
    assert canary_layer_count({"num_hidden_layers": 18, "layer_types": types}, None) == 12
    assert canary_layer_count({"num_hidden_layers": 2}, None) == 2
    assert canary_layer_count({"num_hidden_layers": 32}, 5) == 5


@pytest.mark.parametrize("layers", range(5, 130))  # below 5 layers no id can sit between two gaps
def test_canary_ids_have_the_shape_of_productions(layers):
    """Gaps everywhere, last id = K, a middle id: the shape that makes count-preserving remaps visible."""
    ids = canary_layer_ids(layers)
    assert id_set_shape_problems(ids, layers) == []
    assert ids == sorted(set(ids))
    assert ids[0] >= 1
    if layers >= 8:
        assert len(ids) == 4
        assert ids[0] == 2  # production's count and first id
    # issue 13's remap (id k from layer k+1 whenever k+1 < N) moves at least one id of this set
    assert any(k + 1 < layers for k in ids)


def test_contiguous_ids_are_refused_by_the_shape_check():
    assert "two ids are adjacent" in id_set_shape_problems([1, 2, 3, 4], 4)
    assert "last id is not 8" in id_set_shape_problems([2, 4, 6], 8)


def _candidates(tokens: int = 12, hidden: int = 16, layers: int = 8):
    """Reference states where adjacent layers are close (a residual stream with small updates)."""
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(tokens, hidden, generator=generator)]
    for _ in range(layers):
        states.append(states[-1] + 0.3 * torch.randn(tokens, hidden, generator=generator))
    states.append(states[-1] / states[-1].pow(2).mean(-1, keepdim=True).sqrt())  # post-norm
    labels = [str(k) for k in range(layers + 1)] + ["post-norm"]
    return labels, torch.stack(states, dim=1)


@pytest.mark.parametrize(
    "sources",
    [
        {2: "3", 4: "5", 6: "7"},  # issue 13: k -> k+1 below N
        {2: "1", 4: "3", 6: "5", 8: "7"},  # all one layer too early
        {2: "4", 4: "2"},  # two ids swapped
        {4: "2", 6: "2", 8: "2"},  # every id from the first id's layer
        {4: "5"},  # off by one only in the middle
        {8: "post-norm"},  # last id after the final norm
        {8: "7"},  # last id from the layer before
    ],
)
def test_match_slots_names_every_remapped_slot(sources):
    from eagle3_workflow.canary.check import convention_row
    from eagle3_workflow.reference.layer_match import match_slots, squared_distances

    labels, candidates = _candidates()
    ids = [2, 4, 6, 8]
    columns = [labels.index(sources.get(k, str(k))) for k in ids]
    # capture noise of its own seed, not of whatever RNG state earlier tests left (0.01 against the 0.3 between
    # adjacent layers: any draw names the same slots; 300 seeds x these 7 cases checked, none differed)
    noise = 0.01 * torch.randn(candidates.shape[0], 4, 16, generator=torch.Generator().manual_seed(1))
    extracted = (candidates[:, columns] + noise).to(torch.bfloat16)
    matches = match_slots(ids, labels, squared_distances(extracted, candidates), extracted.float().pow(2).sum((0, 2)))
    assert {m.claimed: m.best for m in matches if not m.ok} == sources
    row = convention_row(matches, 8)
    assert not row.passed
    for claimed, source in sources.items():
        assert f"id {claimed} is layer {source}" in row.found


def test_match_slots_passes_a_correct_capture_and_reports_the_margin():
    from eagle3_workflow.canary.check import convention_row
    from eagle3_workflow.reference.layer_match import match_slots, squared_distances

    labels, candidates = _candidates()
    ids = [2, 4, 6, 8]
    extracted = candidates[:, [2, 4, 6, 8]].to(torch.bfloat16)
    matches = match_slots(ids, labels, squared_distances(extracted, candidates), extracted.float().pow(2).sum((0, 2)))
    assert all(m.ok for m in matches)
    assert min(m.margin for m in matches) > 5
    assert convention_row(matches, 8).passed
    assert "weakest margin" in convention_row(matches, 8).found


def test_truncation_keeps_only_needed_tensors():
    assert keep_tensor("model.embed_tokens.weight", 3)
    assert keep_tensor("model.layers.2.mlp.down_proj.weight", 3)
    assert not keep_tensor("model.layers.3.mlp.down_proj.weight", 3)
    assert not keep_tensor("model.layers.61.eh_proj.weight", 3)  # DeepSeek MTP layer
    assert keep_tensor("lm_head.weight", 3)
    cfg = truncated_config({"num_hidden_layers": 8, "layer_types": ["a"] * 8, "num_nextn_predict_layers": 1}, 3)
    assert cfg["num_hidden_layers"] == 3
    assert cfg["layer_types"] == ["a"] * 3
    assert "num_nextn_predict_layers" not in cfg


def test_the_canary_opens_its_reference_while_the_server_starts_and_raises_what_opening_raised(tmp_path):
    """hf_fp32: the reference skeleton is opened in a thread; its failure (here: no target in the folder) reaches
    the stage when the reference is asked for, as UnsupportedTarget. self_consistency opens none."""
    from eagle3_workflow.canary.check import opening_reference
    from eagle3_workflow.canary.slice import CanarySlice
    from eagle3_workflow.reference.full_depth import UnsupportedTarget

    piece = CanarySlice(tmp_path / "model", 2, [1, 2], 64)
    opened = opening_reference(piece, "hf_fp32", trust_remote_code=False)
    with pytest.raises(UnsupportedTarget, match="config.json"):
        opened()
    assert opening_reference(piece, "self_consistency", trust_remote_code=False) is None
