"""The story's target, in miniature: the Kimi-K2.5 stand-in (config/presets/kimi-k25-stand-in.yaml: the release's
wrapper and tensor names, a DeepSeek-V3-style MoE under text_config) built by the workflow and served at tensor
parallelism 2 on CPU, through every gate to a trained draft: check_api, the canary (streamed fp32 reference, MoE rule)
and the full-depth proof at every production id, the id equal to the layer count included (vLLM once dropped it on
DeepSeek/Kimi: issue 46788), then speculators' trainer on the stand-in, then the preset's own evaluation (vLLM
serving target + draft at TP 2, the preset's evaluate section unchanged) and its lossless verdict: the argmax check
alone (evaluate.lossless_reference: none, the preset says why), with both comparisons recorded.
"""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO, TINY_DATA, rules_run, run_workflow

PRESET = REPO / "config" / "presets" / "kimi-k25-stand-in.yaml"
IDS = [2, 4, 5, 8]  # [2, N//2, N-3, N] of the stand-in's 8 layers


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_kimi_stand_in_at_tp2_through_every_gate_to_a_lossless_evaluation(tmp_path):
    config = yaml.safe_load(PRESET.read_text())
    config["data"] |= {"sources": [{"path": str(TINY_DATA), "format": "sharegpt"}], "max_samples": 48}
    config["train"] |= {"epochs": 1}
    run = tmp_path / "results" / config["run"]
    proc = run_workflow(tmp_path, config, targets=[f"results/{config['run']}/eval/acceptance.json"], timeout=2700)
    assert {"build_kimi_k25_target", "check_api", "canary", "extract_hidden_states", "validate_hidden_states",
            "train_draft", "evaluate_draft"} <= set(rules_run(proc))  # fmt: skip

    target = json.loads((run / "target" / "config.json").read_text())
    assert target["architectures"] == ["KimiK25ForConditionalGeneration"]
    api = json.loads((run / "checks" / "api_compat.json").read_text())
    assert api["passed"] and api["layer_ids"] == IDS
    rows = {row["name"]: row["found"] for row in api["checks"]}
    assert "the text model, tensors under 'language_model.'" in rows["full-depth reference"]

    canary = json.loads((run / "checks" / "canary.json").read_text())
    assert canary["passed"] and canary["proof"] == "hf_fp32"
    assert sorted(int(i) for i in canary["layer_matches"]) == canary["canary_layer_ids"] == [2, 4, 6, 8]
    assert all(match["best"] == i for i, match in canary["layer_matches"].items())
    assert "(Worker_TP1 pid=" in (run / "logs" / "canary.log").read_text(), "the canary's server was not TP 2"

    validation = json.loads((run / "hidden_states" / "validation.json").read_text())
    assert validation["passed"] and validation["samples_valid"] == validation["samples_expected"] == 48
    full_depth = validation["full_depth"]
    assert full_depth["passed"] and full_depth["proof"] == "hf_fp32" and full_depth["layer_ids"] == IDS
    assert [slot["claimed"] for slot in full_depth["slots"]] == IDS
    assert all(slot["ok"] and slot["best"] == str(slot["claimed"]) for slot in full_depth["slots"])
    assert any(slot["ambiguous_tokens"] > 0 for slot in full_depth["slots"]), "no MoE routing seen"
    assert "(Worker_TP1 pid=" in (run / "logs" / "extract_hidden_states_replica_0.log").read_text()

    draft = json.loads((run / "draft" / "config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"
    training = json.loads((run / "draft" / "training.json").read_text())
    assert training["steps"] > 0

    acceptance = json.loads((run / "eval" / "acceptance.json").read_text())
    assert acceptance["lossless"] and acceptance["lossless_reference"] == "none"
    assert acceptance["lossless_criterion"].startswith("every emitted token of every run is its own argmax")
    for label in ("trained", "untrained"):
        assert acceptance[label]["non_argmax_steps"] == [] and acceptance[label]["non_argmax_min_gap_steps"] is None
    assert any("lossless reference: none" in note for note in acceptance["notes"])
    assert acceptance["processes"][0]["runs"] == [f"{label} (production)" for label in ("no_speculation", "trained",
                                                                                         "untrained")]  # fmt: skip
    assert "(Worker_TP1 pid=" in (run / "logs" / "evaluate_draft.log").read_text(), "the evaluation was not TP 2"
