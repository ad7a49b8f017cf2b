"""The untrained baseline: a draft of the trained one's shape whose trainable weights are fresh."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass
class UntrainedDraft:
    path: Path
    description: str
    frozen_tensors_differing: list[str]


def build_untrained_draft(trained_dir: Path, target_dir: Path, out_dir: Path, seed: int) -> UntrainedDraft:
    """A draft of the trained one's shape with freshly initialised trainable weights.

    As speculators' trainer builds a fresh draft from a saved config (speculators.train.cli.
    _build_from_config_only): the model from the config, the trained draft's d2t/t2d vocabulary mapping, then
    the verifier's embeddings and (draft-vocabulary) lm_head, frozen. Only fc, the decoder layer(s) and the norm
    are random, so the baseline differs from the trained draft exactly in what training changed.
    """
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(trained_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # construction only; never serialised
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).resolve())
    trained = load_file(str(trained_dir / "model.safetensors"))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config=config)
    model.load_vocab_mappings(trained.get("t2d"), trained.get("d2t"))
    model.load_verifier_weights()
    reference_weight = trained.get("fc.weight")
    if reference_weight is not None:
        model.to(reference_weight.dtype)  # the trained draft's storage dtype (buffers d2t/t2d keep theirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))

    fresh = load_file(str(out_dir / "model.safetensors"))
    differing = []
    for name in ("d2t", "t2d", "embed_tokens.weight", "lm_head.weight"):
        if name in trained and name in fresh:
            a, b = trained[name], fresh[name]
            same = a.shape == b.shape and (
                torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a.float(), b.float(), atol=1e-2)
            )
            if not same:
                differing.append(name)
    description = (
        f"fresh fc/decoder/norm weights (torch seed {seed}) from {trained_dir}/config.json; d2t/t2d from the "
        "trained draft; embed_tokens and lm_head from the verifier, frozen, as speculators initialises them"
    )
    if differing:
        description += f"; NOTE differs from the trained draft in frozen tensors {differing}"
    return UntrainedDraft(out_dir, description, differing)
