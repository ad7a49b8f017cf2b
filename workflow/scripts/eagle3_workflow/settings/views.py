"""Typed, read-only views of the validated config: each stage's settings, and nothing it does not read.

This module: the base View and the helpers that turn a config into a view and back (config_of, stage_settings,
view_of, with_schema_defaults, as_config); the sections' views live in settings.sections, one model per stage
in settings.stages.

A stage's model here is the one declaration of which config keys the stage reads. Its rule's ``params.settings``
are derived from it (common.smk's ``stage_params("<rule>")``, which is ``config_of(rule_settings_model(rule, config),
config)``: RULE_SETTINGS[rule], or ONLINE_RULE_SETTINGS[rule] where train.hidden_states is online):
the values of exactly the keys the model declares, so the rule reruns exactly when one of them changes. The stage
validates them back into the model (``stage_settings(CanaryStage, snakemake.params.settings)``) and reads
attributes: ``settings.train.lr``.

- **Keys, types and defaults live in the schema** (workflow/schemas/config.schema.yaml): no field here has a
  default, since the validated config always carries every key. The one exception is ``target.build``, which has
  no schema default and is absent when target.path is set.
- **One model per stage** (``<Rule>Stage``; ``RULE_SETTINGS`` maps rule names to them). A section that a stage
  reads in part has a smaller view (ExtractionStall is the 3 keys the canary reads). The larger view extends the
  smaller one, so each field is typed once and a larger view is accepted wherever the smaller one is expected.
- **frozen, extra="forbid"**: a view cannot be changed, and a key its stage does not declare is refused.
- tests/unit/test_settings.py checks every rule's settings against its stage model, every field against the
  schema (names, types, enums, null), and that no field has a default.

JSON Schema's ``number`` is ``Number`` (``int | float``): an int stays an int, so a value a stage records (the
regenerate section in regenerated.stats.json) is the value the config gave.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3_workflow.settings.errors import StageError

Number = int | float
SCHEMA_PATH = Path(__file__).resolve().parents[3] / "schemas" / "config.schema.yaml"


class View(BaseModel):
    """A read-only view of validated config values."""

    model_config = ConfigDict(frozen=True, extra="forbid")


StageModel = TypeVar("StageModel", bound=View)


def nested_view(annotation: Any) -> type[View] | None:
    """The view a field holds (X, or X | None), else None: its keys are read one by one."""
    candidates = (annotation, *typing.get_args(annotation))
    return next((t for t in candidates if isinstance(t, type) and issubclass(t, View)), None)


def config_of(model: type[View], config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the keys `model` declares, taken from `config` (a whole validated config, or the section a
    section view models): nested as in the config, keys sorted at every level, so that a rule's params (whose
    repr is the rerun trigger) do not depend on the order of the config file. A rule's params.settings are
    config_of(its stage's model, config). A key the model declares without a default must be in `config`."""
    picked: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if name not in config:
            if field.is_required():
                raise KeyError(f"{model.__name__} reads {name!r}, which the config does not have")
            continue  # target.build: absent when target.path is set
        view = nested_view(field.annotation)
        value = config[name]
        picked[name] = config_of(view, value) if view is not None and isinstance(value, Mapping) else value
    return _sorted(picked)


def stage_settings(model: type[StageModel], settings: Mapping[str, Any]) -> StageModel:
    """A rule's params.settings as its stage's model; a mismatch is a bug of the workflow, named with its fix."""
    try:
        return model.model_validate(settings)
    except ValidationError as exc:
        raise StageError(
            f"the rule's params.settings do not fit {model.__module__}.{model.__name__}: {exc!r}\n"
            "A rule's settings are stage_params(<its own name>) (workflow/rules/common.smk), the keys its model in "
            "RULE_SETTINGS declares: the rule must name itself, its stage must validate with that same model, and "
            "the model must follow the schema; tests/unit/test_settings.py checks all three."
        ) from exc


def with_schema_defaults(**sections: Any) -> dict[str, Any]:
    """A validated config that sets only `sections` (over a minimal run), every other key at the schema's default:
    settings for code that runs without a config file (benches, tests), from the one place defaults live."""
    from eagle3_workflow.settings.schema import validate_config

    config: dict[str, Any] = {"run": "defaults", "target": {"path": "target"}, "data": {}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    validate_config(config, SCHEMA_PATH)
    return config


def view_of(model: type[StageModel], config: Mapping[str, Any]) -> StageModel:
    """`model` of the keys it declares in `config`, for code that has no rule (benches, tests). A stage uses
    stage_settings, which refuses a key it does not declare."""
    return model.model_validate(config_of(model, config))


def as_config(view: View) -> dict[str, Any]:
    """A view as the config dict it came from (config_of's shape): JSON values, keys sorted, and a key the config
    left out (target.build) left out."""
    return _sorted(view.model_dump(mode="json", exclude_unset=True))


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(item) for item in value]
    return value
