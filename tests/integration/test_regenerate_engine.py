"""Self-distillation for real: the vLLM engine process on the tiny target, its failure, and the rule through
Snakemake. The pure functions, driven by a fake generator: tests/unit/test_regenerate.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import REGENERATE_SETTINGS, SEED_PROMPTS, rules_run, run_workflow, tiny_config, tiny_settings

from eagle3_workflow.regenerate.stage import run_subprocess
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import RegenerateResponsesStage
from eagle3_workflow.target_check.sanity import SANITY_PROMPTS


def _cpu_config(**regenerate_overrides) -> RegenerateResponsesStage:
    """The stage's settings on the tiny preset (CPU), regenerating with REGENERATE_SETTINGS and `regenerate_overrides`."""
    regenerate = {**REGENERATE_SETTINGS, "max_tokens": 24, "magpie_max_tokens": 24, **regenerate_overrides}
    return tiny_settings(RegenerateResponsesStage, regenerate=regenerate)


@pytest.mark.slow
def test_a_failing_subprocess_is_a_stage_error_with_its_last_lines(tmp_path):
    import logging

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    with pytest.raises(StageError) as info:
        run_subprocess(
            tmp_path / "no-model",
            [prompts],
            _cpu_config(),
            logging.getLogger("eagle3.test_regenerate"),
            output=tmp_path / "o.jsonl",
            stats_path=tmp_path / "s.json",
        )
    assert "exited with code 1" in str(info.value)
    assert "no-model" in str(info.value)
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_workflow_regenerates_then_prepares(tmp_path):
    """The rules of the data path, as a run that regenerates takes them: check_target asks the served tiny target
    through its chat template (a plain vLLM server, /v1/chat/completions, the report written), then the rule's
    engine process regenerates (prompt files and magpie prompts) with its statistics and its output in the rule's
    log, then prepare_data reads what it wrote. (check_target gates regeneration unless disabled, in Snakemake's
    plan: tests/integration/test_target_check_rule.py.)"""
    from transformers import AutoTokenizer

    config = tiny_config(
        "regen",
        regenerate={
            "enabled": True,
            "prompt_files": [str(SEED_PROMPTS)],
            "magpie_prompts": 4,
            "max_tokens": 24,
            "max_prompts": 40,
        },
        target_check={"enabled": True, "max_tokens": 16},
    )
    proc = run_workflow(tmp_path, copy.deepcopy(config), extra=["--until", "prepare_data"])
    assert rules_run(proc).index("check_target") < rules_run(proc).index("regenerate_responses")
    run = tmp_path / "results" / "regen"
    report = json.loads((run / "checks" / "target_sanity.json").read_text())
    assert report["passed"]
    assert len(report["answers"]) == len(SANITY_PROMPTS)
    assert all(a["answer"].strip() for a in report["answers"])
    assert all(a["problem"] is None for a in report["answers"])
    assert all(a["finish_reason"] in ("stop", "length") for a in report["answers"])
    tokenizer = AutoTokenizer.from_pretrained(run / "target")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in report["stop_token_ids"]
    assert (run / "logs" / "check_target.log").read_text().count("asked ") == len(SANITY_PROMPTS)

    data = run / "data"
    stats = json.loads((data / "regenerated.stats.json").read_text())
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["sources"] == ["results/regen/data/regenerated.jsonl"]
    assert manifest["records_read"] == stats["conversations_written"] > 0
    assert stats["conversations_written"] == len((data / "regenerated.jsonl").read_text().splitlines())
    assert list(stats["prompts_read"]) == [str(SEED_PROMPTS)]
    assert stats["magpie_requested"] == 4
    assert stats["generated_tokens"] > 0
    assert stats["engine_ready_s"] > 0
    log = (run / "logs" / "regenerate_responses.log").read_text()
    assert "vLLM ready" in log, "the engine process's output reaches the rule's log"
    assert log.count("| ") > 10
