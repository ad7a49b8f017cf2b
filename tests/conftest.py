"""Shared fixtures: repository paths, tiny targets built once per session, and a workflow runner.

Tests run the real thing: real tokenizers, real vLLM (CPU build), the real speculators trainer. A tiny target
per architecture is built once per session (a few seconds each).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3_workflow.settings import DataPreparation, TinyShape, view_of, with_schema_defaults

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = str(VENV_BIN / "snakemake")
TINY_PRESET = REPO / "config" / "presets" / "tiny.yaml"
TINY_DATA = REPO / "config" / "data" / "tiny_conversations.jsonl"
SEED_PROMPTS = REPO / "config" / "data" / "seed_prompts.txt"


def tiny_config(run: str = "t", **overrides: dict) -> dict:
    """The tiny preset with absolute data paths (tests run in temporary working directories)."""
    config = yaml.safe_load(TINY_PRESET.read_text())
    config["run"] = run
    config["data"]["sources"] = [{"path": str(TINY_DATA), "format": "sharegpt"}]
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


def validated(config: dict) -> dict:
    """A copy of `config` as the rules see it: checked by the schema, every default filled."""
    from eagle3_workflow.config_errors import validate_config
    from eagle3_workflow.settings import SCHEMA_PATH

    config = copy.deepcopy(config)
    validate_config(config, SCHEMA_PATH)
    return config


def preparation(**values) -> DataPreparation:
    """The data settings prepare_data reads, setting `values`: the schema's defaults elsewhere."""
    return view_of(DataPreparation, with_schema_defaults(data=values)["data"])


def tiny_settings(model, **overrides: dict):
    """`model` of the tiny preset (tiny_config(**overrides)) as the rules validate it."""
    return view_of(model, validated(tiny_config(**overrides)))


def run_workflow(
    workdir: Path,
    config: dict,
    targets: list[str] | None = None,
    extra: list[str] | None = None,
    check: bool = True,
    timeout: float = 1500,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the real workflow in `workdir` with `config`; returns the completed process (output captured)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / f"config-{config['run']}.yaml"
    config_path.write_text(yaml.safe_dump(copy.deepcopy(config)))
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(workdir),
        "--cores",
        "2",
        *(targets or []),
        *(extra or []),
        "--configfile",  # last: it takes every following word as a config file
        str(config_path),
    ]
    full_env = {**os.environ, **(env or {})}
    full_env["PATH"] = f"{VENV_BIN}{os.pathsep}{full_env.get('PATH', '')}"
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-12000:]}"
        )
    return proc


def api_report(target: Path, **overrides):
    """check_api's report on a target, with the CPU settings the tests use (keyword overrides win)."""
    from eagle3_workflow.api_checks import run_api_checks

    kwargs = dict(
        target_dir=str(target),
        prepared_dir=None,
        configured_layer_ids=None,
        vllm_min="0.18.0",
        vllm_max_exclusive="0.34.0",
        device="cpu",
        trust_remote_code=False,
    )
    return run_api_checks(**(kwargs | overrides))


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Build tiny targets lazily, once per architecture: tiny_targets('llama') -> Path."""
    from eagle3_workflow.tiny_target import build_tiny_target

    root = tmp_path_factory.mktemp("tiny_targets")
    built: dict[str, Path] = {}

    def get(arch: str = "llama", num_layers: int = 8) -> Path:
        key = f"{arch}-{num_layers}"
        if key not in built:
            build = {"kind": "tiny", "arch": arch, "num_layers": num_layers}
            shape = view_of(TinyShape, with_schema_defaults(target={"build": build})["target"]["build"])
            built[key] = build_tiny_target(root / key, [TINY_DATA, SEED_PROMPTS], shape)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_targets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_targets("llama"))
