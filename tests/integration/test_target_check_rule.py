"""Rule check_target through Snakemake: it gates regeneration unless disabled. The real rule asking the served tiny
target through its chat template, before the regeneration it gates: tests/integration/test_regenerate_engine.py::
test_workflow_regenerates_then_prepares. The verdict, the stop set and the rest on their own:
tests/unit/test_target_check.py."""

from __future__ import annotations

import pytest
from conftest import SEED_PROMPTS, run_workflow, tiny_config


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
