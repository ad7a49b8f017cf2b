"""The draft parity check's reference (parity judges with it): what the trained draft proposes at every step of a
served trajectory, predicted from that trajectory alone, without vLLM:

- the target's hidden states at the draft's aux layers come from reference.full_depth.stream_reference (the fp32
  HF forward of the whole target, the canary's and the full-depth check's reference; vLLM's layer-id convention);
- the draft is speculators' own Eagle3DraftModel, built from the TRAINER's final checkpoint (draft/training.json's
  final_checkpoint: the config and weights the trainer saved, not the served draft/ copy), fed the layers the
  trainer trained on (training.json's target_layer_ids), run by speculators' own forward in fp32: step 0 over every
  position at once (token x[j+1], hidden H[j]), steps 1..k-1 with the draft's own pre-norm output as the hidden
  state and the trajectory's tokens as inputs (teacher forcing: a proposal counts only while every earlier one
  was accepted, i.e. equal to the trajectory, so these are exactly the tokens vLLM's loop feeds);
- vLLM's loop: at a step whose context ends at token x[m], the draft proposes k tokens from position m-1,
  verification accepts the longest prefix equal to the target's greedy tokens x[m+1..], and the target adds the
  bonus token. Each step is predicted from the served step's own start, so one excused tie does not shift the rest.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.draft_artefacts import TrainingSummary


@dataclasses.dataclass
class TrainedDraft:
    """What the reference runs: the trainer's checkpoint (or, without one, the draft folder itself) and the target
    layers it was trained on."""

    checkpoint: Path
    layer_ids: list[int]
    independent: bool  # False: the served folder's own files (a config fault in it cannot be seen)
    source: str


def trained_draft(draft: Path) -> TrainedDraft:
    """The trainer's final checkpoint named by draft/training.json, if it is still on disk; else draft/ itself."""
    config = json.loads((draft / "config.json").read_text())
    summary_path = draft / "training.json"
    if summary_path.is_file():
        summary = load(TrainingSummary, summary_path)
        path = Path(summary.final_checkpoint.path)
        candidates = [path] if path.is_absolute() else [Path.cwd() / path, draft.parent.parent.parent / path]
        for candidate in candidates:
            if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
                return TrainedDraft(candidate.resolve(), list(summary.target_layer_ids), True,
                                    f"the trainer's final checkpoint {candidate} (training.json), its target layers "
                                    f"{list(summary.target_layer_ids)}")  # fmt: skip
        layer_ids = list(summary.target_layer_ids)
    else:
        layer_ids = list(config.get("eagle_aux_hidden_state_layer_ids") or [])
    return TrainedDraft(draft.resolve(), layer_ids, False,
                        f"the served draft's own files {draft} (no trainer checkpoint on disk: a fault in its "
                        "config.json or weights is not seen, only how vLLM reads them)")  # fmt: skip


def load_reference_draft(trained: TrainedDraft, target: Path) -> Any:
    """speculators' Eagle3DraftModel from the checkpoint's config and weights, fp32, eager attention (a dense
    mask: runs on CPU); an embedding the checkpoint lacks comes from the target, as vLLM shares it."""
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(trained.checkpoint))
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    config.eagle_aux_hidden_state_layer_ids = list(trained.layer_ids)
    model = Eagle3DraftModel(config)
    state = load_file(str(trained.checkpoint / "model.safetensors"))
    if "embed_tokens.weight" not in state:
        from eagle3_workflow.reference.target_config import read_tensors, text_weight_prefix

        prefix = text_weight_prefix(target)
        state["embed_tokens.weight"] = read_tensors(target, [f"{prefix}model.embed_tokens.weight"]).popitem()[1]
    model.load_state_dict(state, strict=False)
    return model.to(torch.float32).eval()


@dataclasses.dataclass
class Predicted:
    """One prompt's reference: per draft step t, the draft's logits [positions, draft vocab] and the target id of
    its argmax per position (position j: the context ends at token j + 1 of the trajectory)."""

    logits: list[Any]
    proposals: list[list[int]]
    inputs: list[Any]  # per draft step, lm_head's input [positions, hidden]
    head: Any  # lm_head's weight [draft vocab, hidden]
    num_draft_layers: int


def predict(model: Any, aux: Any, trajectory: Sequence[int], k: int) -> Predicted:
    """speculators' forward over one trajectory (prompt + served output): k TTT steps, logits captured."""
    import torch

    captured: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []

    def keep(_module: Any, args: tuple, out: torch.Tensor) -> None:
        inputs.append(args[0][0].detach())
        captured.append(out[0].detach())

    hook = model.lm_head.register_forward_hook(keep)
    ids = torch.tensor([list(trajectory)])
    try:
        # force_eager: speculators compiles its forward; torch 2.11's CPU inductor (the GPU machine's image) fails
        # to build it (CppCompileError, 2026-12-06), and a 4-prompt fp32 reference needs no compiled kernels
        with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            model(hidden_states=aux[None, :-1].float(), input_ids=ids[:, 1:], document_ids=torch.zeros_like(ids[:, 1:]),
                  ttt_steps=k)  # fmt: skip
    finally:
        hook.remove()
    to_target = target_ids(model)
    proposals = [[int(to_target[d]) for d in logits.argmax(-1).tolist()] for logits in captured]
    return Predicted(
        logits=captured,
        proposals=proposals,
        inputs=inputs,
        head=model.lm_head.weight.detach(),
        num_draft_layers=len(model.layers),
    )


def target_ids(model: Any) -> list[int]:
    """Draft id -> target id (d2t holds target id - draft id; no d2t: the same vocabulary)."""
    d2t = getattr(model, "d2t", None)
    n = model.lm_head.out_features
    return list(range(n)) if d2t is None else [i + int(d2t[i]) for i in range(n)]


def aux_states(target: Path, trajectories: Sequence[Sequence[int]], layer_ids: Sequence[int], *,
               trust_remote_code: bool, device: str) -> list[Any]:  # fmt: skip
    """Per trajectory [T, len(layer_ids) x H]: the fp32 reference's inputs of the aux layers (vLLM's convention)."""
    import torch

    from eagle3_workflow.reference.full_depth import stream_reference

    wanted = {str(i) for i in layer_ids}
    got: dict[str, torch.Tensor] = {}

    def visit(label: str, states: torch.Tensor) -> None:
        if label in wanted:
            got[label] = states.detach().float().clone()

    stream_reference(target, [list(t) for t in trajectories], visit, trust_remote_code=trust_remote_code,
                     device=device)  # fmt: skip
    return [torch.cat([got[str(i)][b, : len(t)] for i in layer_ids], dim=-1) for b, t in enumerate(trajectories)]
