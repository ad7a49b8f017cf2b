"""Publishing the draft: the final checkpoint minus resume-only state, metrics.csv and training.json, checked to be
the EAGLE-3 draft vLLM expects, all or nothing."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.draft_artefacts import DraftConfig, TrainingSummary
from eagle3_workflow.files.writing import published_directory
from eagle3_workflow.settings.errors import StageError

# Files of a checkpoint that only serve resuming; the rest (config, weights, provenance) goes to draft/
RESUME_ONLY_FILES = {"optimizer_state_dict.pt", "scheduler_state_dict.pt", "training_state.json"}


def publish_draft(checkpoint: Path, out_dir: Path, metrics, summary: TrainingSummary) -> None:
    """Copy the final checkpoint (minus resume-only state) and the tables into out_dir, checked, all or nothing."""
    with published_directory(out_dir) as staging:
        for item in checkpoint.iterdir():
            if item.is_file() and item.name not in RESUME_ONLY_FILES:
                shutil.copy2(item, staging / item.name)
        metrics.to_csv(staging / "metrics.csv", index=False)
        write(staging / "training.json", summary)
        verify_draft(staging, draft_vocab_size=summary.draft_vocab_size, target_layer_ids=summary.target_layer_ids)


def verify_draft(out_dir: Path, *, draft_vocab_size: int, target_layer_ids: Sequence[int]) -> None:
    """The checkpoint is the EAGLE-3 draft vLLM expects (model type, vocab, layer ids), with finite weights."""
    import torch
    from safetensors import safe_open

    config = load(DraftConfig, out_dir / "config.json")
    problems = []
    if config.speculators_model_type != "eagle3":
        problems.append(f"speculators_model_type is {config.speculators_model_type!r}, expected 'eagle3'")
    if config.draft_vocab_size != draft_vocab_size:
        problems.append(f"draft_vocab_size is {config.draft_vocab_size}, expected {draft_vocab_size}")
    if list(config.eagle_aux_hidden_state_layer_ids or []) != list(target_layer_ids):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids is {config.eagle_aux_hidden_state_layer_ids}, expected "
            f"{list(target_layer_ids)}"
        )
    with safe_open(out_dir / "model.safetensors", framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            tensor = handle.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problems.append(f"tensor {name} has non-finite values")
    if problems:
        raise StageError(f"the trained draft is not usable ({out_dir}): " + "; ".join(problems))
