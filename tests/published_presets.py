"""The published presets the tests check (config/presets/*.yaml other than tiny), with the target shape each
model card gives, read alone or with the schema's defaults filled (tests/unit/test_presets.py,
tests/integration/test_presets_dry_run.py)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import yaml
from conftest import REPO
from snakemake.utils import validate

SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"


@dataclasses.dataclass(frozen=True)
class TargetShape:
    """What the model card says; the preset must agree."""

    num_layers: int
    hidden_size: int
    trust_remote_code: bool


PRESETS = {
    "llama-3.1-8b": TargetShape(num_layers=32, hidden_size=4096, trust_remote_code=False),
    "qwen3-8b": TargetShape(num_layers=36, hidden_size=4096, trust_remote_code=False),
    "kimi-k2.5-int4": TargetShape(num_layers=61, hidden_size=7168, trust_remote_code=True),
}


def preset_path(name: str) -> Path:
    return REPO / "config" / "presets" / f"{name}.yaml"


def load_preset(name: str) -> dict:
    return yaml.safe_load(preset_path(name).read_text())


def with_defaults(config: dict) -> dict:
    config = copy.deepcopy(config)
    validate(config, str(SCHEMA))  # fills the schema's defaults in place
    return config


GPU_SMOLLM2 = "smollm2-135m-gpu"  # builds its own target (no target.path): not in PRESETS' dry run through SLURM
