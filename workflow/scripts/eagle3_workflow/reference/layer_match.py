"""Which reference layer each captured slot came from: the matching the canary (on its slice) and the full-depth
check of validate_hidden_states (on the whole model) share.

Every slot is compared with every candidate source in vLLM's convention: label str(k) for k in 0..N-1 is HF
``output_hidden_states[k]`` (the input of layer k), str(N) the pre-norm output of the last layer, POST_NORM the final
norm's output. A slot is nearest to the layer it claims, or the capture is wrong; the distance is summed over all
tokens of all samples, so one noisy token decides nothing. Pure: torch only.

The error row (max |slot - own layer| / max |own layer|, per sample) and mixture-of-experts targets. Measured on a
tiny DeepSeek-V3 (hidden 128, 8 experts, top-2, 7 MoE layers; vLLM bf16 vs this fp32 reference): the canary failed at
0.0786 while the bulk of tokens sat at 0.005-0.013. Each of the 5 tokens above 0.03 had, at one upstream MoE layer,
a gap of 6e-5..6.4e-4 between its k-th and (k+1)-th corrected router score; routing that one token at that one layer
with those two experts swapped brought its error to 0.004-0.008 (swapping at any other layer did not). So bf16
serving routes near-tied tokens to the other expert, and a per-token maximum turns one such flip into a failure.
vLLM's router logits are bf16 (GateLinear, out_dtype None) and its router input has drifted from fp32 by a few bf16
roundings, so a gap below that reach is a coin toss, not a capture fault.

The rule (RoutingProbe, excused_tokens): for every token and MoE layer the reference records the gap between the
k-th and (k+1)-th selection score and the bound the served model's rounding can move it by:
``u (s'_a |z_a| + s'_b |z_b|) + 3 rho ||x|| ||s'_a w_a - s'_b w_b|| / sqrt(H)``, u = 2^-8 (bf16: one rounding of
each logit z), rho = ROUTING_DRIFT = 2^-6 (the served router input's relative deviation: 4 bf16 roundings; measured
0.011-0.013 through the slice), taken as a random direction (3 standard deviations of its effect on the gap); s' the
score's derivative (sigmoid scoring: s(1 - s); softmax routers compare logits: 1), x the router input, w_a, w_b the
two experts' router rows. A token whose gap is below its bound at any MoE layer before id k is AMBIGUOUS at id k.
An ambiguous token above the tolerance is EXCUSED from the error row (counted, reported); a token that is not
ambiguous never is, so the row's metric and tolerance are unchanged for dense targets (no router: nothing is
ambiguous) and for every token a flip cannot explain. At most MAX_EXCUSED_FRACTION of an id's tokens may be
excused, or the row fails. Excusing only tokens above the tolerance rather than dropping every ambiguous one
checks strictly more tokens with the same verdict (an ambiguous token within tolerance passes either way). The
layer-id convention (match_slots) always uses every token.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import torch

# a checkpoint tensor of decoder layer k (group 2): "model.layers.3.mlp...", "language_model.model.layers.3..."
LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")
POST_NORM = "post-norm"  # label of the final norm's output: a plausible wrong source for id N
BF16_ROUNDING = 2.0**-8  # unit roundoff of bf16: the served model's router logits are bf16
ROUTING_DRIFT = 2.0**-6  # relative deviation of the served router input from fp32: 4 bf16 roundings
ROUTING_SIGMAS = 3.0  # the gap's bound: this many standard deviations of that deviation's effect
MAX_EXCUSED_FRACTION = 0.1  # at most this share of an id's tokens may be excused as routing flips


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


def token_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One slot of one sample ([T, H]) against its own layer: per token max |diff| / max |ref| over all tokens (their
    maximum is the error row's metric), and mean |diff| / mean |ref|."""
    got, ref = got.float(), ref.float()
    diff = (got - ref).abs()
    per_token = diff.max(dim=-1).values / ref.abs().max().clamp_min(1e-12)
    return per_token, float(diff.mean() / ref.abs().mean().clamp_min(1e-12))


# ------------------------------------------------------------------------------------------------ MoE routing


def topk_gap_and_bound(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    sigmoid: bool = False,
    groups: int = 1,
    topk_groups: int = 1,
    drift: float = ROUTING_DRIFT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's decision per token: (gap, bound), each [T]. gap: k-th minus (k+1)-th selection score (DeepSeek-V3:
    sigmoid(z) + bias among the selected groups; softmax routers: the logits z, softmax is monotone); bound: how far
    the served model's rounding can move that gap (the module docstring's formula). x [T, H], weight [E, H]."""
    x, weight = x.float(), weight.float()
    logits = x @ weight.T
    if sigmoid:
        scores = logits.sigmoid()
        slope = scores * (1 - scores)
        choice = scores + (bias.float() if bias is not None else 0.0)
    else:
        slope = torch.ones_like(logits)
        choice = logits
    if groups > 1:  # DeepSeek's group-limited routing: only the best topk_groups groups compete
        grouped = choice.view(choice.shape[0], groups, -1)
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    order = choice.topk(top_k + 1, dim=-1)
    gap = order.values[:, top_k - 1] - order.values[:, top_k]
    a, b = order.indices[:, top_k - 1], order.indices[:, top_k]
    slope_a, slope_b = slope.gather(1, a[:, None])[:, 0], slope.gather(1, b[:, None])[:, 0]
    z_a, z_b = logits.gather(1, a[:, None])[:, 0], logits.gather(1, b[:, None])[:, 0]
    rounding = BF16_ROUNDING * (slope_a * z_a.abs() + slope_b * z_b.abs())
    direction = (slope_a[:, None] * weight[a] - slope_b[:, None] * weight[b]).norm(dim=-1)
    deviation = ROUTING_SIGMAS * drift * x.norm(dim=-1) * direction / math.sqrt(x.shape[-1])
    return gap, rounding + deviation


def router_decision(module: Any, router_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gap, bound) of a transformers MoE router module on its input, or None when `module` is no router known
    here: DeepSeek-V3/Kimi-K2's TopkRouter (sigmoid, e_score_correction_bias, groups) and softmax top-k routers
    (a `*Router` with `top_k` and an [E, H] weight: Qwen3-MoE, Mixtral, ...)."""
    weight, top_k = getattr(module, "weight", None), getattr(module, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        return None
    if weight.is_meta or top_k >= weight.shape[0]:
        return None
    x = router_input.reshape(-1, weight.shape[1])
    bias = getattr(module, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        groups = int(getattr(module, "num_group", 1) or 1)
        return topk_gap_and_bound(x, weight, top_k, bias=bias, sigmoid=True, groups=groups,
                                  topk_groups=int(getattr(module, "topk_group", 1) or 1))  # fmt: skip
    if type(module).__name__.endswith("Router"):
        return topk_gap_and_bound(x, weight, top_k)
    return None


class RoutingProbe:
    """Records every MoE router's decision margins during a reference forward (a torch-global forward hook, so it
    needs no hold of the model: the reference may build and free it as it likes). The layer a router belongs to is
    the depth label last visited (the reference visits str(k) just before layer k runs). ambiguous[k]: [B, T] bool,
    the tokens whose gap at MoE layer k is below its bound."""

    def __init__(self) -> None:
        self.layer: int | None = None
        self.shape: tuple[int, int] | None = None  # (B, T) of the batch
        self.ambiguous: dict[int, torch.Tensor] = {}
        self.decisions = 0
        self._handle: Any = None

    def visited(self, label: str, states: torch.Tensor) -> None:
        if label.isdigit():
            self.layer = int(label)
            self.shape = (int(states.shape[0]), int(states.shape[1]))

    def _hook(self, module: Any, args: tuple, _output: Any) -> None:
        if self.layer is None or self.shape is None or not args or not isinstance(args[0], torch.Tensor):
            return
        if args[0].numel() != self.shape[0] * self.shape[1] * getattr(module, "weight", args[0]).shape[-1]:
            return
        decision = router_decision(module, args[0].detach())
        if decision is None:
            return
        gap, bound = decision
        self.decisions += 1
        flagged = (gap < bound).reshape(self.shape).cpu()  # the reference may run on a GPU (reference.device)
        self.ambiguous[self.layer] = self.ambiguous.get(self.layer, torch.zeros_like(flagged)) | flagged

    def __enter__(self) -> RoutingProbe:
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._handle.remove()

    def upstream(self, layer_id: int, sample: int, tokens: int) -> torch.Tensor:
        """[tokens] bool: ambiguous at some MoE layer before `layer_id` (those make the input of layer `layer_id`)."""
        out = torch.zeros(tokens, dtype=torch.bool)
        for layer, flagged in self.ambiguous.items():
            if layer < layer_id:
                out |= flagged[sample, :tokens]
        return out


@dataclasses.dataclass
class SlotError:
    """One id's error row: the largest error of the tokens not excused, and how many were ambiguous, excused."""

    max_rel: float  # over the tokens not excused, the worst sample
    raw_max_rel: float  # over every token
    mean_rel: float  # mean |diff| / mean |ref|, the worst sample
    tokens: int
    ambiguous: int
    excused: int

    @property
    def excused_ok(self) -> bool:
        return self.excused <= MAX_EXCUSED_FRACTION * self.tokens


def excused_tokens(per_token: torch.Tensor, ambiguous: torch.Tensor, tolerance: float) -> torch.Tensor:
    """The tokens excused from the error row: above the tolerance AND routed ambiguously upstream. Pure."""
    return ambiguous & (per_token > tolerance)


class SlotComparison:
    """The extracted slots of the samples ([T_b, L, H] each) against every reference depth as it streams by (a
    Visit): summed squared distances per slot and candidate (match_slots), and each slot's per-token error against
    its own layer (errors). Shared by the canary (its slice) and the full-depth check (the whole target)."""

    def __init__(self, slots: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> None:
        self.slots = [s.float() for s in slots]
        self.layer_ids = list(layer_ids)
        self.sq_norm = sum(s.pow(2).sum(dim=(0, 2)) for s in self.slots)
        self.sq_dist: dict[str, torch.Tensor] = {}
        self.per_token: dict[str, list[torch.Tensor]] = {}
        self.mean_rel: dict[str, float] = {}
        self.routing = RoutingProbe()

    def __call__(self, label: str, states: torch.Tensor) -> None:
        self.routing.visited(label, states)
        dist = torch.zeros(len(self.layer_ids))
        own = label.isdigit() and int(label) in self.layer_ids
        for b, got in enumerate(self.slots):
            ref = states[b, : got.shape[0]].float()
            dist += squared_distances(got, ref[:, None, :])[:, 0]
            if own:
                per_token, mean = token_errors(got[:, self.layer_ids.index(int(label))], ref)
                self.per_token.setdefault(label, []).append(per_token)
                self.mean_rel[label] = max(self.mean_rel.get(label, 0.0), mean)
        self.sq_dist[label] = dist

    def matches(self, num_layers: int) -> list[SlotMatch]:
        labels = [str(k) for k in range(num_layers + 1)] + [POST_NORM]
        missing = [label for label in labels if label not in self.sq_dist]
        if missing:
            raise ValueError(f"the reference produced no state for depths {missing}; it did not run through")
        return match_slots(self.layer_ids, labels, torch.stack([self.sq_dist[x] for x in labels], dim=1), self.sq_norm)

    def errors(self, tolerance: float) -> dict[str, SlotError]:
        """Each id's error row under the routing rule (module docstring)."""
        out = {}
        for layer_id in self.layer_ids:
            label = str(layer_id)
            kept, raw, tokens, ambiguous, excused = 0.0, 0.0, 0, 0, 0
            for b, per_token in enumerate(self.per_token.get(label, [])):
                flagged = self.routing.upstream(layer_id, b, per_token.shape[0])
                excuse = excused_tokens(per_token, flagged, tolerance)
                raw = max(raw, float(per_token.max()))
                if bool((~excuse).any()):
                    kept = max(kept, float(per_token[~excuse].max()))
                tokens, ambiguous, excused = (
                    tokens + per_token.shape[0],
                    ambiguous + int(flagged.sum()),
                    excused + int(excuse.sum()),
                )
            out[label] = SlotError(kept, raw, self.mean_rel.get(label, 0.0), tokens, ambiguous, excused)
        return out
