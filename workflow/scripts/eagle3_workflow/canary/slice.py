"""The canary's slice: a K-layer copy of the target (every distinct layer type covered, e.g. DeepSeek-V3/Kimi's dense
layers plus the first MoE layer, and at least 8 layers so the captured ids can have production's shape), written from
only the tensors it keeps, read lazily from the safetensors shards; and the ids captured from it, shaped like
production's [2, N//2, N-3, N]: [2, K//2, K-2, K].

A multimodal wrapper (Kimi-K2.5) keeps its layout in the slice: tensor names as stored (``language_model.`` prefix),
the depth cut in ``text_config``, its quantization_config where it was, every tensor outside the decoder layers
(vision tower, projector: their ``blocks.N`` are not decoder layers), the processor files beside the tokenizer's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_workflow.files.hidden_states import HiddenStateFiles
from eagle3_workflow.files.target_weights import weight_files
from eagle3_workflow.reference.layer_match import LAYER_KEY
from eagle3_workflow.reference.target_config import read_target_config, read_tensors, text_section

log = logging.getLogger("eagle3.canary")


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
# what vLLM's processor of a multimodal wrapper reads (Kimi-K2.5: preprocessor_config.json); vLLM refuses the folder
# without it, although the canary serves text only
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


MIN_SHAPED_LAYERS = 8  # the fewest layers where [2, K//2, K-2, K] has a gap between every pair of ids


def canary_layer_count(text: Mapping[str, Any], requested: int | None) -> int:
    """Layers to keep: every distinct layer type covered and room for a production-shaped id set (>= 8). `text`: the
    language model's part of the config (TargetConfig.text)."""
    total = int(text["num_hidden_layers"])
    if requested:
        return min(requested, total)
    needed = MIN_SHAPED_LAYERS
    dense = text.get("first_k_dense_replace")
    if dense is not None:
        needed = max(needed, int(dense) + 1)  # the dense layers plus the first MoE layer
    layer_types = text.get("layer_types")
    if layer_types:
        first_seen: dict[str, int] = {}
        for i, kind in enumerate(layer_types):
            first_seen.setdefault(str(kind), i)
        needed = max(needed, max(first_seen.values()) + 1)
    return min(needed, total)


def canary_layer_ids(layers: int) -> list[int]:
    """Ids with the shape of production's [2, N//2, N-3, N] on a K-layer slice.

    A gap between every pair of ids, the last id = K (the pre-norm output), and middle ids that are neither
    first nor adjacent to another: a capture bug that remaps ids only when that keeps their count (which is
    invisible on a contiguous 1..K set) moves at least one slot here. K-2 rather than K-3 keeps the gap at K=8.
    """
    if layers >= MIN_SHAPED_LAYERS:
        return [2, layers // 2, layers - 2, layers]
    if layers <= 2:
        return list(range(1, layers + 1))
    return sorted(range(layers, 0, -2))[-4:]  # every second layer down from K: gaps, at most four ids


def id_set_shape_problems(ids: list[int], layers: int) -> list[str]:
    """What keeps `ids` from having production's shape on a K-layer slice (empty = fine)."""
    problems = []
    if not ids or ids[-1] != layers:
        problems.append(f"last id is not {layers}")
    if any(b - a < 2 for a, b in zip(ids, ids[1:], strict=False)):
        problems.append("two ids are adjacent")
    if not any(0 < i < len(ids) - 1 for i in range(len(ids))):
        problems.append("no middle id")
    return problems


def truncated_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    text = text_section(out)
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    text.pop("num_nextn_predict_layers", None)  # MTP layers are not part of the slice
    return out


def keep_tensor(name: str, layers: int) -> bool:
    match = LAYER_KEY.search(name)
    return match is None or int(match.group(2)) < layers


def build_truncated_target(target_dir: Path, out_dir: Path, layers: int) -> dict[str, Any]:
    """Write a K-layer copy of the checkpoint, reading only the kept tensors (lazy safe_open, sharded or not)."""
    from safetensors.torch import save_file

    config = read_target_config(target_dir)
    files = weight_files(target_dir)
    tensors = read_tensors(target_dir, files, [name for name in files if keep_tensor(name, layers)])
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(truncated_config(config.raw, layers), indent=2))
    for name in TOKENIZER_FILES + PROCESSOR_FILES:
        if (target_dir / name).exists():
            shutil.copy2(target_dir / name, out_dir / name)
    for extra in target_dir.glob("*.py"):  # remote-code modules (used only when trust_remote_code is set)
        shutil.copy2(extra, out_dir / extra.name)
    log.info(
        "canary target: %d of %d layers, %d tensors -> %s",
        layers,
        config.num_layers,
        len(tensors),
        out_dir,
    )
    return config.raw


@dataclasses.dataclass(frozen=True)
class CanarySlice:
    """The K-layer slice of the target the canary serves: where it is written, and the ids captured from it."""

    model_dir: Path
    layers: int
    layer_ids: list[int]
    hidden_size: int

    def files(self, folder: Path) -> HiddenStateFiles:
        return HiddenStateFiles(folder, len(self.layer_ids), self.hidden_size)
