"""Which reference layer each captured slot came from: the matching the canary (on its slice) and the full-depth
check of validate_hidden_states (on the whole model) share.

Every slot is compared with every candidate source in vLLM's convention: label str(k) for k in 0..N-1 is HF
``output_hidden_states[k]`` (the input of layer k), str(N) the pre-norm output of the last layer, POST_NORM the final
norm's output. A slot is nearest to the layer it claims, or the capture is wrong; the distance is summed over all
tokens of all samples, so one noisy token decides nothing. Pure: torch only.
"""

from __future__ import annotations

import dataclasses
import re

import torch

# a checkpoint tensor of decoder layer k (group 2): "model.layers.3.mlp...", "language_model.model.layers.3..."
LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")
POST_NORM = "post-norm"  # label of the final norm's output: a plausible wrong source for id N


def squared_distances(extracted: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """[L, C]: sum over tokens and features of (slot l - candidate c)^2 (fp32)."""
    got = extracted.float()
    return torch.stack([(got[:, j, None, :] - candidates).pow(2).sum(dim=(0, 2)) for j in range(got.shape[1])])


@dataclasses.dataclass
class SlotMatch:
    claimed: int
    best: str
    best_rel: float  # ||slot - best|| / ||slot||
    runner_up: str
    runner_up_rel: float
    own_rel: float

    @property
    def ok(self) -> bool:
        return self.best == str(self.claimed)

    @property
    def margin(self) -> float:
        """How much farther the second-nearest layer is than the nearest one (>1; large = unambiguous)."""
        return self.runner_up_rel / max(self.best_rel, 1e-12)


def match_slots(
    layer_ids: list[int], labels: list[str], sq_dist: torch.Tensor, sq_norm: torch.Tensor
) -> list[SlotMatch]:
    """Each captured slot's nearest reference layer (plain distance, so every candidate is judged alike)."""
    matches = []
    for j, claimed in enumerate(layer_ids):
        rel = (sq_dist[j] / sq_norm[j].clamp_min(1e-24)).sqrt().tolist()
        order = sorted(range(len(labels)), key=rel.__getitem__)
        matches.append(
            SlotMatch(
                claimed=claimed,
                best=labels[order[0]],
                best_rel=rel[order[0]],
                runner_up=labels[order[1]],
                runner_up_rel=rel[order[1]],
                own_rel=rel[labels.index(str(claimed))],
            )
        )
    return matches


def compare_layers(
    extracted: torch.Tensor, reference: torch.Tensor, layer_ids: list[int]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per id against its own reference: max error / max |ref|, mean error / mean |ref|."""
    max_rel, mean_rel = {}, {}
    for j, layer_id in enumerate(layer_ids):
        got = extracted[:, j].float()
        ref = reference[:, j].float()
        diff = (got - ref).abs()
        max_rel[str(layer_id)] = float(diff.max() / ref.abs().max().clamp_min(1e-12))
        mean_rel[str(layer_id)] = float(diff.mean() / ref.abs().mean().clamp_min(1e-12))
    return max_rel, mean_rel
