"""Rule check_target through Snakemake: it gates regeneration unless disabled, and (slow) asks the served tiny
target through its chat template. The verdict, the stop set and the rest on their own: tests/unit/test_target_check.py."""

from __future__ import annotations

import json

import pytest
from conftest import SEED_PROMPTS, run_workflow, tiny_config

from eagle3_workflow.target_check.sanity import SANITY_PROMPTS


def regenerating_config(run: str, enabled: bool) -> dict:
    return tiny_config(
        run,
        regenerate={"enabled": True, "prompt_files": [str(SEED_PROMPTS)], "max_tokens": 16, "max_prompts": 4},
        target_check={"enabled": enabled, "max_tokens": 16},
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_regeneration_waits_for_check_target_unless_disabled(tmp_path, enabled):
    config = regenerating_config("gate", enabled)
    proc = run_workflow(tmp_path, config, targets=["results/gate/data/regenerated.jsonl"], extra=["-n"])
    assert ("check_target" in proc.stdout) is enabled, proc.stdout


@pytest.mark.slow
def test_check_target_asks_the_served_target_through_its_template(tmp_path):
    """The real rule on the tiny target: a plain vLLM server, /v1/chat/completions, the report written."""
    run_workflow(tmp_path, regenerating_config("sane", True), targets=["results/sane/checks/target_sanity.json"])
    report = json.loads((tmp_path / "results" / "sane" / "checks" / "target_sanity.json").read_text())
    assert report["passed"]
    assert len(report["answers"]) == len(SANITY_PROMPTS)
    assert all(a["answer"].strip() for a in report["answers"])
    assert all(a["problem"] is None for a in report["answers"])
    assert all(a["finish_reason"] in ("stop", "length") for a in report["answers"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "results" / "sane" / "target")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in report["stop_token_ids"]
    log = (tmp_path / "results" / "sane" / "logs" / "check_target.log").read_text()
    assert log.count("asked ") == len(SANITY_PROMPTS)
