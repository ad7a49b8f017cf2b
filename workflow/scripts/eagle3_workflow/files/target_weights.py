"""The target checkpoint's weight map: which safetensors file holds each tensor, read from
model.safetensors.index.json (or the one model.safetensors), and written for a builder. Here, below the stages and
the concerns, so that every package reads the map one way: the reference and the canary to load tensors,
serving.fit to count the bytes vLLM loads. Pure: the standard library only (a header is read, never mapped)."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_workflow.settings.errors import StageError


class NotSafetensors(StageError):
    """The target directory has neither model.safetensors nor model.safetensors.index.json."""


def weight_files(target_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (relative to target_dir) that holds it, sharded or not. NotSafetensors when
    the directory has neither model.safetensors nor model.safetensors.index.json."""
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = target_dir / "model.safetensors"
    if not single.exists():
        raise NotSafetensors(
            f"{target_dir} has neither model.safetensors nor model.safetensors.index.json; only safetensors "
            "checkpoints can be read"
        )
    names = [name for name in safetensors_header(single) if name != "__metadata__"]
    return dict.fromkeys(names, "model.safetensors")


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (8 bytes of little-endian length, then the header: each tensor's dtype, shape
    and data offsets, and `__metadata__`), read without mapping the file: safetensors' safe_open maps all of it, and
    on a machine whose memory is smaller than the file (a 128 GB single-file checkpoint on a 24 GiB host, Linux's
    default overcommit) that map is refused with "Cannot allocate memory"."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise StageError(f"{path} is not a safetensors file: {len(prefix)} bytes, shorter than its header length")
        (length,) = struct.unpack("<Q", prefix)
        size = path.stat().st_size
        if length > size - 8:
            raise StageError(
                f"{path} is not a safetensors file (or is cut short): its header claims {length} bytes of the file's "
                f"{size}. Fix: copy the checkpoint again"
            )
        return json.loads(handle.read(length))


def write_weight_index(target_dir: Path, weight_map: Mapping[str, str], total_size: int) -> Path:
    """model.safetensors.index.json of a sharded checkpoint (the format weight_files reads): tensor name -> its
    file, names sorted; total_size the bytes of every tensor."""
    index = target_dir / "model.safetensors.index.json"
    payload = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    index.write_text(json.dumps(payload, indent=2) + "\n")
    return index
