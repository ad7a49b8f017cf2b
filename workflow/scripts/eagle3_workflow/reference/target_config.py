"""The target checkpoint on disk, read in one place: its config.json as a small typed view (`read_target_config`), and
its tensors (`read_tensors`, by the weight map of files.target_weights.weight_files).

Multimodal wrappers (Gemma 3, Llama 4, ...) keep the language model's shape in ``text_config``; `text_section` is the
one place that knows it. Pure: json and safetensors only (no transformers, no torch import at module level).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_workflow.settings.errors import StageError

if TYPE_CHECKING:
    import torch

    from eagle3_workflow.files.target_artefacts import TargetInfo


def text_section(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json dict: ``text_config`` when there is one, else the whole dict (the
    same object, so a caller may edit it in place, as the canary's truncated copy does)."""
    return config.get("text_config") or config


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A target's config.json: the fields the workflow uses, by name; `raw` for the rest."""

    path: str  # the model directory, as the config names it (recorded so in api_compat.json)
    raw: dict[str, Any]

    @property
    def text(self) -> dict[str, Any]:
        return text_section(self.raw)

    @property
    def architecture(self) -> str:
        architectures = self.raw.get("architectures") or []
        return architectures[0] if architectures else ""

    @property
    def model_type(self) -> str:
        """The checkpoint's model_type (a multimodal wrapper's own, e.g. gemma3)."""
        return self.raw.get("model_type", "")

    @property
    def decoder_model_type(self) -> str | None:
        """The language model's model_type (text_config's when it names one, e.g. gemma3_text)."""
        return self.text.get("model_type") or self.raw.get("model_type")

    @property
    def num_layers(self) -> int:
        return int(self._required("num_hidden_layers"))

    @property
    def hidden_size(self) -> int:
        return int(self._required("hidden_size"))

    @property
    def vocab_size(self) -> int:
        return int(self.text.get("vocab_size", 0))

    @property
    def dtype(self) -> str | None:
        """The language model's stored dtype ("bfloat16"), as transformers reads it (``dtype``, formerly
        ``torch_dtype``, of the text section only), or None when the config names none."""
        found = self.text.get("dtype") or self.text.get("torch_dtype")
        return None if found is None else str(found).removeprefix("torch.")

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.text.get("tie_word_embeddings", self.raw.get("tie_word_embeddings", False)))

    def info(self) -> TargetInfo:
        """check_api's record of the target (api_compat.json's ``target``)."""
        from eagle3_workflow.files.target_artefacts import TargetInfo

        return TargetInfo(
            path=self.path,
            architecture=self.architecture,
            model_type=self.model_type,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
        )

    def _required(self, key: str) -> Any:
        if key not in self.text:
            where = "text_config" if "text_config" in self.raw else "the top level"
            raise StageError(
                f"{Path(self.path) / 'config.json'} has no {key!r} (looked in {where}): not the config of a decoder model "
                "transformers and vLLM can serve. Point target.path at the model's HF directory (config.json with "
                "num_hidden_layers and hidden_size)"
            )
        return self.text[key]


def read_target_config(target_dir: str | Path) -> TargetConfig:
    """The target's config.json; StageError naming the file when it is missing or not JSON."""
    config_path = Path(target_dir) / "config.json"
    if not config_path.exists():
        raise StageError(f"{config_path} does not exist: target.path must be a HF model directory")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StageError(
            f"{config_path} cannot be read as JSON ({exc!r}); restore the model directory's config.json "
            "(download or convert the target again)"
        ) from exc
    if not isinstance(raw, dict):
        raise StageError(f"{config_path} holds a JSON {type(raw).__name__}, not an object; restore the model's config")
    return TargetConfig(path=str(target_dir), raw=raw)


TEXT_PREFIX = "language_model."  # where a multimodal wrapper's checkpoint keeps its language model (Kimi-K2.5)
_TEXT_LAYER = re.compile(r"^language_model\.model\.layers\.\d+\.")


def text_weight_prefix(files: Mapping[str, str]) -> str:
    """What stands before the language model's own tensor names in this checkpoint: TEXT_PREFIX when it stores its
    decoder layers as ``language_model.model.layers.N...`` (Kimi-K2.5), else "" (``model.layers.N...``)."""
    return TEXT_PREFIX if any(_TEXT_LAYER.match(name) for name in files) else ""


def read_tensors(target_dir: Path, files: Mapping[str, str], names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Only the tensors named, each file opened (safe_open) and closed again: no file stays mapped after the call."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    tensors = {}
    for file, in_file in by_file.items():
        with safe_open(str(target_dir / file), framework="pt", device="cpu") as handle:
            tensors.update({name: handle.get_tensor(name) for name in in_file})
    return tensors
