"""The target checkpoint's weight map: which safetensors file holds each tensor, read from
model.safetensors.index.json (or the one model.safetensors), and written for a builder. Here, below the stages and
the concerns, so that every package reads the map one way: the reference and the canary to load tensors,
serving.fit to count the bytes vLLM loads. Pure: json and safetensors only."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from eagle3_workflow.settings.errors import StageError


class NotSafetensors(StageError):
    """The target directory has neither model.safetensors nor model.safetensors.index.json."""


def weight_files(target_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative to target_dir) that holds it, sharded or not. NotSafetensors when
    the directory has neither model.safetensors nor model.safetensors.index.json."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_dir / "model.safetensors"
    if not single.exists():
        raise NotSafetensors(
            f"{target_dir} has neither model.safetensors nor model.safetensors.index.json; only safetensors "
            "checkpoints can be read"
        )
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), "model.safetensors")


def write_weight_index(target_dir: Path, weight_map: Mapping[str, str], total_size: int) -> Path:
    """model.safetensors.index.json of a sharded checkpoint (the format weight_files reads): tensor name -> its
    file, names sorted; total_size the bytes of every tensor."""
    index = target_dir / "model.safetensors.index.json"
    payload = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    index.write_text(json.dumps(payload, indent=2) + "\n")
    return index
