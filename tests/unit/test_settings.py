"""Typed settings (eagle3_workflow.settings): defaults live only in the schema.

- Every rule's params.settings (its stage_params("<rule>"), loaded through Snakemake's API for the presets that
  have every rule) validates into its stage's model, and carries exactly the keys the model declares: the rule
  names itself, and the derivation (settings.views.config_of) loses no key and adds none.
- Every model field mirrors the schema: the key exists, same JSON type(s), same enum, null where the schema allows
  it; a section modelled whole has every key of the section; no field has a default.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import (
    CanarySettings,
    CheckApiSettings,
    EvaluateSettings,
    HiddenStatesSettings,
    OnlineTraining,
    OnlineTrainSettings,
    ReferenceSettings,
    RegenerateSettings,
    TargetBuild,
    TargetSettings,
    ValidationSettings,
    VllmSettings,
)
from eagle3_workflow.settings.stages import ONLINE_RULE_SETTINGS, RULE_SETTINGS, PackageDraftStage, rule_settings_model
from eagle3_workflow.settings.views import View, as_config, config_of, stage_settings, with_schema_defaults

SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
PRESETS = ["tiny", "smollm2-135m"]  # between them, every rule of the workflow
# the schema's only key without a default that a stage reads whole: absent from the config when target.path is set
MAY_BE_ABSENT = {"target/build"}


# a rule no preset runs: the tiny preset with the Kimi-K2.5 stand-in as its target (build_kimi_k25_target)
EXTRA_PLANS = {"tiny-kimi": ("tiny", {"target": {"build": {"kind": "kimi_k25", "hidden_size": 128}}})}


def rules_of(preset: str, workdir: Path, override: dict | None = None) -> dict[str, Any]:
    """The preset's rules (`override` a later config file), parsed by Snakemake (no DAG): name -> rule."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import ConfigSettings, OutputSettings, ResourceSettings, StorageSettings

    extra = []
    if override:
        extra = [workdir / "override.yaml"]
        extra[0].write_text(yaml.safe_dump(override))
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[REPO / "config" / "presets" / f"{preset}.yaml", *extra]),
            storage_settings=StorageSettings(),
            snakefile=REPO / "Snakefile",
            workdir=workdir,
        )
        return {rule.name: rule for rule in workflow_api._workflow.rules}


@pytest.fixture(scope="module")
def rule_settings(tmp_path_factory) -> dict[str, dict]:
    """rule -> its params.settings, over the presets (a rule in both has the same keys in both)."""
    found: dict[str, dict] = {}
    plans = [(preset, None, preset) for preset in PRESETS]
    plans += [(preset, override, name) for name, (preset, override) in EXTRA_PLANS.items()]
    for preset, override, name in plans:
        for rule_name, rule in rules_of(preset, tmp_path_factory.mktemp(name), override).items():
            if "settings" in rule.params.keys():
                found.setdefault(rule_name, rule.params.settings)
    return found


def leaves(value: Any, prefix: str = "") -> set[str]:
    """The "section/key/..." paths of a nested dict's values."""
    if isinstance(value, dict) and value:
        return set().union(*(leaves(v, f"{prefix}/{k}" if prefix else k) for k, v in value.items()))
    return {prefix}


def nested_view(annotation: Any) -> type[View] | None:
    """The view a field holds (X, or X | None), else None; not the items of a tuple (a list in the config: one
    leaf, its items checked against the schema's `items`)."""
    candidates = (annotation, *(() if typing.get_origin(annotation) is tuple else typing.get_args(annotation)))
    return next((t for t in candidates if isinstance(t, type) and issubclass(t, View)), None)


def declared_leaves(model: type[View], prefix: str = "") -> set[str]:
    """The config paths a view declares, nested views expanded."""
    found: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}/{name}" if prefix else name
        view = nested_view(field.annotation)
        found |= declared_leaves(view, path) if view is not None else {path}
    return found


def fields(model: type[View], prefix: str = "") -> list[tuple[str, Any]]:
    """(config path, FieldInfo) of every field of a view and of the views it holds."""
    found = []
    for name, field in model.model_fields.items():
        path = f"{prefix}/{name}" if prefix else name
        found.append((path, field))
        view = nested_view(field.annotation)
        if view is not None:
            found += fields(view, path)
    return found


def schema_at(path: str) -> dict:
    node = SCHEMA
    for key in path.split("/"):
        node = node["properties"][key]
    return node


# ---------------------------------------------------------------- rules <-> stage models


def test_every_rule_with_settings_has_a_stage_model(rule_settings):
    assert set(rule_settings) == set(RULE_SETTINGS)


def test_each_rule_passes_exactly_the_keys_its_stage_model_declares(rule_settings):
    drift = {}
    for rule, settings in rule_settings.items():
        model = RULE_SETTINGS[rule]
        passed, declared = leaves(settings), declared_leaves(model)
        if passed != declared:
            drift[rule] = {
                f"passed by the rule, not in {model.__name__}": sorted(passed - declared),
                f"in {model.__name__}, not passed by the rule": sorted(declared - passed),
            }
    assert drift == {}
    for rule, settings in rule_settings.items():
        view = stage_settings(RULE_SETTINGS[rule], settings)  # values the schema accepted, the model accepts
        assert as_config(view) == settings, f"{rule}: the view does not give back what the rule passed"


def test_a_key_the_stage_does_not_declare_is_refused_with_the_fix(rule_settings):
    settings = {**rule_settings["train_draft"], "vllm": {"device": "cpu"}}
    with pytest.raises(StageError, match=r"(?s)TrainDraftStage.*extra_forbidden.*stage_params"):
        stage_settings(RULE_SETTINGS["train_draft"], settings)
    missing = {"train": rule_settings["train_draft"]["train"]}
    with pytest.raises(StageError, match=r"(?s)target.*missing"):
        stage_settings(RULE_SETTINGS["train_draft"], missing)


def test_a_user_target_without_build_reaches_the_model_card():
    config = with_schema_defaults(run="r", target={"path": "/models/t"})
    assert "build" not in config["target"]
    settings = {key: config[key] for key in PackageDraftStage.model_fields}
    assert config_of(PackageDraftStage, config) == settings
    view = stage_settings(PackageDraftStage, settings)
    assert view.target.build is None and as_config(view) == settings


def reversed_order(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: reversed_order(value[key]) for key in reversed(list(value))}
    return value


def test_params_do_not_depend_on_the_order_of_the_config():
    """A param's repr is Snakemake's rerun trigger: the same values in another key order must give the same repr."""
    config = with_schema_defaults(run="r", target={"path": "/models/t"})
    reads_build = (RULE_SETTINGS["build_tiny_target"], RULE_SETTINGS["build_kimi_k25_target"])  # absent here
    for model in RULE_SETTINGS.values():
        if model not in reads_build:
            assert repr(config_of(model, config)) == repr(config_of(model, reversed_order(config)))
    params = config_of(RULE_SETTINGS["evaluate_draft"], reversed_order(config))
    assert list(params) == sorted(params) and list(params["evaluate"]) == sorted(params["evaluate"])


def test_params_of_a_config_without_a_key_the_stage_reads_name_it():
    config = with_schema_defaults(run="r", target={"path": "/models/t"})
    del config["train"]["lr"]
    with pytest.raises(KeyError, match="TrainSettings reads 'lr'"):
        config_of(RULE_SETTINGS["train_draft"], config)


# ---------------------------------------------------------------- models <-> schema

JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}


def json_shape(annotation: Any) -> tuple[frozenset[str], frozenset | None, Any]:
    """(JSON types, enum values or None, item annotation or None) of a field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [json_shape(a) for a in args]
        kinds = frozenset().union(*(p[0] for p in parts))
        if {"integer", "number"} <= kinds:  # Number = int | float is JSON Schema's number
            kinds -= {"integer"}
        enums = [p[1] for p in parts if p[1] is not None]
        items = next((p[2] for p in parts if p[2] is not None), None)
        return kinds, frozenset().union(*enums) if enums else None, items
    if origin is typing.Literal:
        return frozenset(JSON_TYPES[type(v)] for v in args), frozenset(args), None
    if origin is tuple:
        return frozenset({"array"}), None, args[0]
    if isinstance(annotation, type) and issubclass(annotation, View):
        return frozenset({"object"}), None, None
    return frozenset({JSON_TYPES[annotation]}), None, None


def schema_shape(node: dict) -> tuple[frozenset[str], frozenset | None]:
    kinds = node.get("type", "object")
    kinds = frozenset([kinds] if isinstance(kinds, str) else kinds)
    enum = frozenset(node["enum"]) if "enum" in node else None
    if enum is not None and "null" in kinds:
        enum |= {None}
    return kinds, enum


def every_model() -> dict[str, type[View]]:
    """Every view reachable from the stage models, by name."""
    found: dict[str, type[View]] = {}
    todo = list(RULE_SETTINGS.values())
    while todo:
        model = todo.pop()
        if model.__name__ not in found:
            found[model.__name__] = model
            todo += [v for f in model.model_fields.values() if (v := nested_view(f.annotation)) is not None]
    return found


def test_every_field_mirrors_the_schema():
    wrong = {}
    for model in RULE_SETTINGS.values():
        for path, field in fields(model):
            try:
                node = schema_at(path)
            except KeyError:
                wrong[f"{model.__name__}: {path}"] = "no such key in the schema"
                continue
            kinds, enum, items = json_shape(field.annotation)
            if path in MAY_BE_ABSENT:
                kinds -= {"null"}  # None stands for the absent key
            expected = schema_shape(node)
            if (kinds, enum) != expected:
                wrong[f"{model.__name__}: {path}"] = (
                    f"model {sorted(kinds)} {enum}, schema {sorted(expected[0])} {expected[1]}"
                )
            if items is not None and json_shape(items)[0] != schema_shape(node["items"])[0]:
                wrong[f"{model.__name__}: {path}[]"] = f"items {json_shape(items)[0]}, schema {node['items']}"
    assert wrong == {}


# the views of a whole section: a key added to the section is read by every stage that holds one
WHOLE_SECTIONS = {
    "target": TargetSettings,
    "target/build": TargetBuild,
    "regenerate": RegenerateSettings,
    "vllm": VllmSettings,
    "hidden_states": HiddenStatesSettings,
    "check_api": CheckApiSettings,
    "canary": CanarySettings,
    "validation": ValidationSettings,
    "reference": ReferenceSettings,
    "train": OnlineTrainSettings,
    "train/online": OnlineTraining,
    "evaluate": EvaluateSettings,
}


def test_sections_modelled_whole_have_every_key_of_the_schema():
    models = WHOLE_SECTIONS
    differ = {
        path: {"model": sorted(model.model_fields), "schema": sorted(schema_at(path)["properties"])}
        for path, model in models.items()
        if set(model.model_fields) != set(schema_at(path)["properties"])
    }
    assert differ == {}


def test_no_field_has_a_default_the_schema_is_the_only_place():
    with_default = [
        f"{name}.{field_name}"
        for name, model in every_model().items()
        for field_name, field in model.model_fields.items()
        if not field.is_required() and not (name == "TargetSettings" and field_name == "build")
    ]
    assert with_default == []
    assert not every_model()["TargetSettings"].model_fields["build"].is_required()  # absent is None (MAY_BE_ABSENT)


def test_online_training_gives_three_rules_their_online_settings_and_offline_rules_none_of_train_online():
    """train.hidden_states: online changes what extraction, validation and training read (the check set, the
    server); offline none of them reads train.online, so changing it reruns nothing there."""
    offline = with_schema_defaults(run="r", target={"path": "/models/t"})
    online = with_schema_defaults(run="r", target={"path": "/models/t"}, train={"hidden_states": "online"})
    for rule, model in ONLINE_RULE_SETTINGS.items():
        assert rule_settings_model(rule, offline) is RULE_SETTINGS[rule]
        assert rule_settings_model(rule, online) is model
        params = config_of(model, online)
        assert rule_settings_model(rule, params) is model  # the stage finds its model from its params alone
        assert as_config(stage_settings(model, params)) == params
        assert "online" not in config_of(RULE_SETTINGS[rule], offline).get("train", {})
    assert config_of(ONLINE_RULE_SETTINGS["extract_hidden_states"], online)["train"] == {
        "hidden_states": "online",
        "online": {"check_samples": 8},
    }
    assert rule_settings_model("evaluate_draft", online) is RULE_SETTINGS["evaluate_draft"]
