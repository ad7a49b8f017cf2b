"""The untrained baseline: a draft of the trained one's shape whose trainable weights are fresh.

It is built once per recipe (UntrainedDraftInputs: the seed, the trained draft's and the verifier's files by
fingerprint, the libraries that initialise it) and kept in its folder with recipe.json, written last: a later
attempt of the stage finds the same files, so their fingerprint (size:mtime above fingerprint.CONTENT_HASH_LIMIT:
an 8B target's baseline is 1.77 GiB) and with it the keys of the untrained engines' results stay the same, and
those results are reused. A retrained draft, another target or seed, a new torch/transformers/speculators, a build
cut short (no recipe.json) or files changed since it was built: it is built again.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
from pathlib import Path

from eagle3_workflow.evaluation.fingerprint import model_fingerprint
from eagle3_workflow.files.artefacts import ArtefactError, load, write
from eagle3_workflow.files.draft_artefacts import UntrainedDraftInputs, UntrainedDraftRecipe

log = logging.getLogger("eagle3.evaluation")

RECIPE = "recipe.json"
# raise it when build_untrained_draft changes what it writes for the same inputs: every kept baseline is rebuilt
BUILDER_VERSION = 1


@dataclasses.dataclass
class UntrainedDraft:
    path: Path
    description: str
    frozen_tensors_differing: list[str]
    kept: bool = False  # True: an earlier build from the same recipe, its files untouched


def untrained_draft_inputs(trained_dir: Path, target_dir: Path, seed: int) -> UntrainedDraftInputs:
    """What decides the untrained draft's bytes. The folders by model_fingerprint (content below
    CONTENT_HASH_LIMIT, else size:mtime: a retrained draft or a rewritten target counts as changed even with the
    same bytes, which only costs a rebuild)."""
    version = importlib.metadata.version  # the installed distributions' (speculators 0.9.0 has no __version__)
    return UntrainedDraftInputs(
        builder=BUILDER_VERSION,
        seed=seed,
        trained_draft=str(Path(trained_dir).resolve()),
        trained_draft_files=model_fingerprint(Path(trained_dir)),
        target=str(Path(target_dir).resolve()),
        target_files=model_fingerprint(Path(target_dir)),
        torch_version=version("torch"),
        transformers_version=version("transformers"),
        speculators_version=version("speculators"),
    )


def kept_untrained_draft(out_dir: Path, inputs: UntrainedDraftInputs) -> UntrainedDraft | None:
    """The draft in out_dir if its recipe.json records these inputs and the files it holds now; else None, with
    the reason in the log."""
    recipe_path = out_dir / RECIPE
    if not recipe_path.is_file():
        if out_dir.is_dir() and any(out_dir.iterdir()):
            log.info("untrained baseline %s has no %s (a build cut short): building it again", out_dir, RECIPE)
        return None
    try:
        recipe = load(UntrainedDraftRecipe, recipe_path)
    except ArtefactError as exc:
        log.info("untrained baseline %s: its %s cannot be read (%r): building it again", out_dir, RECIPE, exc)
        return None
    before, now = recipe.inputs.model_dump(), inputs.model_dump()
    changed = sorted(k for k in now if before.get(k) != now[k])
    if changed:
        log.info("untrained baseline %s was built from other inputs (%s): building it again", out_dir,
                 ", ".join(changed))  # fmt: skip
        return None
    files = model_fingerprint(out_dir, leave_out=(RECIPE,))
    if files != recipe.files:
        differing = sorted(k for k in files.keys() | recipe.files.keys() if files.get(k) != recipe.files.get(k))
        log.info("untrained baseline %s: files changed since it was built (%s): building it again", out_dir,
                 ", ".join(differing))  # fmt: skip
        return None
    return UntrainedDraft(out_dir, recipe.description, list(recipe.frozen_tensors_differing), kept=True)


def build_untrained_draft(trained_dir: Path, target_dir: Path, out_dir: Path, seed: int) -> UntrainedDraft:
    """A draft of the trained one's shape with freshly initialised trainable weights; the one out_dir holds
    already when it was built from the same recipe (kept_untrained_draft).

    As speculators' trainer builds a fresh draft from a saved config (speculators.train.cli.
    _build_from_config_only): the model from the config, the trained draft's d2t/t2d vocabulary mapping, then
    the verifier's embeddings and (draft-vocabulary) lm_head, frozen. Only fc, the decoder layer(s) and the norm
    are random, so the baseline differs from the trained draft exactly in what training changed.
    """
    inputs = untrained_draft_inputs(trained_dir, target_dir, seed)
    kept = kept_untrained_draft(out_dir, inputs)
    if kept is not None:
        return kept

    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    (out_dir / RECIPE).unlink(missing_ok=True)  # until the files are whole, the folder has no recipe
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
    recipe = UntrainedDraftRecipe(inputs=inputs, files=model_fingerprint(out_dir, leave_out=(RECIPE,)),
                                  description=description, frozen_tensors_differing=differing)  # fmt: skip
    write(out_dir / RECIPE, recipe)  # last, atomically: the files it names are whole
    return UntrainedDraft(out_dir, description, differing)
