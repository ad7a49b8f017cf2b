"""The config schema: presets validate, defaults are filled, bad values name their key."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, api_report, tiny_config
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

SCHEMA = str(REPO / "workflow" / "schemas" / "config.schema.yaml")


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "config" / "presets").glob("*.yaml")))
def test_every_preset_is_schema_valid(preset):
    config = yaml.safe_load((REPO / "config" / "presets" / preset).read_text())
    validate(config, SCHEMA)
    assert config["run"]


def test_defaults_are_filled():
    config = {"run": "x", "target": {"path": "/m"}, "data": {"sources": [{"path": "a.jsonl"}]}}
    validate(config, SCHEMA)
    assert config["extraction"]["replicas"] == 1
    assert config["data"]["on_bad_record"] == "fail"
    assert config["data"]["sources"][0]["format"] == "auto"


@pytest.mark.parametrize(
    "section,values,needle",
    [
        ("extraction", {"replicas": 0}, "replicas"),
        ("data", {"on_bad_record": "ignore"}, "on_bad_record"),
        ("train", {"lr": -1}, "lr"),
        ("vllm", {"gpu_memory_utilization": 2}, "gpu_memory_utilization"),
        ("hidden_states", {"layer_ids": [0, 3]}, "layer_ids"),
        ("extraction", {"concurency": 3}, "concurency"),
    ],
)
def test_bad_value_is_rejected_with_its_key(section, values, needle):
    config = tiny_config()
    config[section] = {**config.get(section, {}), **values}
    with pytest.raises(WorkflowError) as info:
        validate(config, SCHEMA)
    assert needle in str(info.value)


def test_bad_run_name_is_rejected():
    config = tiny_config(run="has space")
    with pytest.raises(WorkflowError, match="run"):
        validate(config, SCHEMA)


def test_unknown_top_level_key_is_named_with_the_allowed_keys():
    from eagle3_workflow.settings.schema import config_errors

    config = tiny_config()
    config["extration"] = {"replicas": 2}
    (line,) = config_errors(config, SCHEMA)
    assert "extration" in line
    assert "extraction" in line
    assert "hidden_states" in line


# ---------------------------------------------------------------- validate_config: Snakemake's validation, schema read once

PRESET_FILES = sorted((REPO / "config" / "presets").glob("*.yaml"))


@pytest.mark.parametrize(
    "config",
    [
        *(yaml.safe_load(p.read_text()) for p in PRESET_FILES),
        {"run": "x", "target": {"path": "/m"}, "data": {"sources": [{"path": "a.jsonl"}]}},
    ],
    ids=[*(p.stem for p in PRESET_FILES), "minimal"],
)
def test_validate_config_fills_what_snakemakes_validate_fills(config):
    import copy

    from eagle3_workflow.settings.schema import validate_config

    ours, snakemakes = copy.deepcopy(config), copy.deepcopy(config)
    validate_config(ours, SCHEMA)
    validate(snakemakes, SCHEMA)
    assert ours == snakemakes


def test_validate_config_refuses_what_snakemakes_validate_refuses():
    from eagle3_workflow.settings.schema import validate_config

    config = tiny_config(extraction={"replicas": 0})
    with pytest.raises(WorkflowError):
        validate(dict(config), SCHEMA)
    with pytest.raises(WorkflowError, match=r"extraction\.replicas"):
        validate_config(config, SCHEMA)


def test_a_filled_default_is_the_configs_own_not_the_cached_schemas():
    from eagle3_workflow.settings.schema import validate_config

    first = {"run": "x", "target": {"path": "/m"}, "data": {}}
    validate_config(first, SCHEMA)
    first["data"]["sources"].append({"path": "mine.jsonl"})  # the default, [], filled in
    second = {"run": "y", "target": {"path": "/m"}, "data": {}}
    validate_config(second, SCHEMA)
    assert second["data"]["sources"] == []


def test_an_edited_schema_is_read_again(tmp_path):
    from eagle3_workflow.settings.schema import validate_config

    schema = tmp_path / "config.schema.yaml"
    schema.write_text((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    config = {"run": "x", "target": {"path": "/m"}, "data": {}}
    validate_config(config, schema)
    assert config["extraction"]["replicas"] == 1
    edited = yaml.safe_load(schema.read_text())
    edited["properties"]["extraction"]["properties"]["replicas"]["default"] = 3
    schema.write_text(yaml.safe_dump(edited) + "# a size the cache cannot mistake\n")
    config = {"run": "x", "target": {"path": "/m"}, "data": {}}
    validate_config(config, schema)
    assert config["extraction"]["replicas"] == 3


# ---------------------------------------------------------------- check_api: a config mistake is not an environment one


def test_layer_id_failures_name_the_key_not_the_environment(tiny_targets):
    from eagle3_workflow.api_checks.checks import failure_advice

    report = api_report(tiny_targets("llama"), configured_layer_ids=[2, 2, 8])
    failed = [r for r in report.checks if not r.passed]
    assert [r.name for r in failed] == ["layer ids"]
    assert "list each layer id once" in failed[0].found
    assert "explicitly" not in failed[0].found
    advice = failure_advice(failed)
    assert "change hidden_states.layer_ids" in advice
    assert "envs/" not in advice
    assert "environment" not in advice.lower()


def test_default_layer_ids_that_collide_ask_for_explicit_ids():
    from eagle3_workflow.files.hidden_states import resolve_layer_ids

    with pytest.raises(ValueError, match="default ids .* collide on a 4-layer target; set hidden_states.layer_ids"):
        resolve_layer_ids(4, None)


def test_environment_failures_name_the_package():
    from eagle3_workflow.api_checks.checks import failure_advice
    from eagle3_workflow.files.artefacts import CheckRow

    advice = failure_advice(
        [
            CheckRow(name="vllm version", expected=">= 0.18.0, < 0.34.0", found="0.40.0", passed=False),
            CheckRow(
                name="speculators train fields",
                expected="TrainConfig has every flag",
                found="missing ['ttt_steps']",
                passed=False,
            ),
        ]
    )
    assert "Environment" in advice
    assert "Config" not in advice
    assert "vllm: install" in advice
    assert "speculators: install" in advice
