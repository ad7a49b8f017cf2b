"""Self-distillation for real: the vLLM engine process on the tiny target, its failure, and the rule through
Snakemake. The pure functions, driven by a fake generator: tests/unit/test_regenerate.py.
"""

from __future__ import annotations

import copy
import json

import pytest
from conftest import REGENERATE_SETTINGS, SEED_PROMPTS, preparation, run_workflow, tiny_config, tiny_settings

from eagle3_workflow.errors import StageError
from eagle3_workflow.prepare.conversations import prepare_conversations
from eagle3_workflow.regenerate.stage import run_subprocess
from eagle3_workflow.settings import RegenerateResponsesStage


def _cpu_config(**regenerate_overrides) -> RegenerateResponsesStage:
    """The stage's settings on the tiny preset (CPU), regenerating with REGENERATE_SETTINGS and `regenerate_overrides`."""
    regenerate = {**REGENERATE_SETTINGS, "max_tokens": 24, "magpie_max_tokens": 24, **regenerate_overrides}
    return tiny_settings(RegenerateResponsesStage, regenerate=regenerate)


@pytest.mark.slow
def test_real_regeneration_on_the_tiny_target(tiny_targets, tmp_path, caplog):
    import logging

    from transformers import AutoTokenizer

    target = tiny_targets("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(SEED_PROMPTS.read_text().splitlines()[:12]) + "\n")
    out, stats_path = tmp_path / "data" / "regenerated.jsonl", tmp_path / "data" / "regenerated.stats.json"
    logger = logging.getLogger("eagle3.test_regenerate")
    with caplog.at_level(logging.INFO, logger="eagle3.test_regenerate"):
        run_subprocess(target, [prompts], _cpu_config(magpie_prompts=4), logger, output=out, stats_path=stats_path)
    assert any("vLLM ready" in r.getMessage() for r in caplog.records), "the subprocess output reaches the log"
    stats = json.loads(stats_path.read_text())
    assert stats["prompts_read"] == {str(prompts): 12}
    assert stats["magpie_requested"] == 4
    assert stats["conversations_written"] == len(out.read_text().splitlines()) > 0
    assert stats["generated_tokens"] > 0
    assert stats["engine_ready_s"] > 0
    tokenizer = AutoTokenizer.from_pretrained(target)
    result = prepare_conversations([(out, "sharegpt")], tokenizer, preparation(max_seq_len=256))
    assert len(result.samples) == stats["conversations_written"]


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
    config = tiny_config(
        "regen",
        regenerate={
            "enabled": True,
            "prompt_files": [str(SEED_PROMPTS)],
            "magpie_prompts": 4,
            "max_tokens": 24,
            "max_prompts": 40,
        },
    )
    run_workflow(tmp_path, copy.deepcopy(config), extra=["--until", "prepare_data"])
    data = tmp_path / "results" / "regen" / "data"
    stats = json.loads((data / "regenerated.stats.json").read_text())
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["sources"] == ["results/regen/data/regenerated.jsonl"]
    assert manifest["records_read"] == stats["conversations_written"] > 0
    assert (tmp_path / "results" / "regen" / "logs" / "regenerate_responses.log").read_text().count("| ") > 10
