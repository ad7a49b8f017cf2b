"""Stage `build_kimi_k25_target`: a Kimi-K2.5 stand-in (tiny, or at the release's widths) in the real checkpoint's
exact layout.

The checkpoint's layout (its config.json, processor files and tensor names, as the release stores them) is
kimi_layout.py's. Here:

Sizes: target.build's widths (``num_heads``, ``q_lora_rank``, ``intermediate_size``, ``moe_intermediate_size``,
``routed_experts``, ``experts_per_token``, ``padded_vocab_size``) left null give the tiny stand-in (8 experts top-2,
widths from hidden_size); set to the release's they give the real width (bench/gpu/kimi-k25-real-width.yaml: every
size of Kimi-K2.5's text_config but the routed experts' width). The vision tower stays tiny at every width.

Weights: one generator on `device`, tensors drawn in name order, deterministic for a seed and a device type (a CUDA
generator draws other numbers than the CPU one; on CPU the draws are those this module has always made). Written
as it goes (ShardWriter): each decoder layer drawn, its routed experts packed in stacks, each file saved once
complete, so memory holds one file's tensors plus the embedding and lm_head (whose file closes with the final norm).

``weights: random``: normal(0, 0.02) linears, norms 1, correction bias uniform [0, 0.05), lm_head 8x: nothing of a
trained model. ``weights: trained_like`` (TrainedLike) reshapes, from the same draws, what the gates are sensitive to:

- Large-magnitude activation channels, as trained LLMs have (outlier features, "massive activations"): layer 0's
  dense MLP writes OUTLIER_CHANNELS hidden dimensions, OUTLIER_RATIO times a typical channel of its output, with a
  fixed sign for every token (units whose gate and up rows are equal output z^2 sigmoid(z) >= 0); the residual
  stream carries them; every later norm (both of each layer, the final one) weights them 1/OUTLIER_RATIO, as
  trained models' norm weights at such channels are small, so the norms' outputs are not swamped. Realistic: a few
  channels (4 of 7168), hundreds of times the median after the first layer, the same channels and signs for every
  token, the norms' RMS dominated by them. Not realistic: they are written once, not maintained; no token (BOS,
  delimiters) is special. Measured (bench/gpu/results/2026-12-06-kimi-k25-real-width-cpu-study/): at hidden 7168,
  316x the median channel at layer 1 and 313x at layer 8; at hidden 256 (the unit tests) 145x falling to 20x by
  layer 4, as the random layers' own output grows there relative to layer 0's MLP.
- Router rows rescaled so that the logits spread ROUTER_LOGIT_STD over the experts on a unit-RMS input at every
  width (random rows spread 0.02 sqrt(H)). Realistic: the release's routing itself (384 experts top-8, sigmoid
  scores plus the fp32 correction bias, one group, scaling 2.827), which sets how close the 8th and 9th scores come:
  the near-tie rate follows from that geometry and barely from the spread (gap and bound both scale with it;
  measured at hidden 7168: 0.75-0.81 of the tokens at each MoE layer trained_like, 0.75-0.79 random). Not
  measured on a trained router (none can be had here): the spread is an assumption, the bias is random rather than
  load-balancing, and experts have no content specialization.

Nothing else is trained-like: attention, experts and embeddings stay random.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_workflow.files.target_weights import write_weight_index
from eagle3_workflow.files.writing import share_as_umask_allows
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import KimiShape
from eagle3_workflow.target_build.kimi_layout import (
    GROUP_SIZE,
    MEDIA_TOKENS,
    QK_ROPE_HEAD_DIM,
    VIDEO_PLACEHOLDER,
    VISION,
    is_routed_expert,
    model_config,
    preprocessor_config,
    text_config,
    text_shapes,
    vision_shapes,
)
from eagle3_workflow.target_build.tiny import build_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("eagle3.kimi_target")

PACKED_PARTS = ("weight_packed", "weight_scale", "weight_shape")
MIN_HIDDEN = 128
EXPERT_NUMBER = re.compile(r"\.experts\.(\d+)\.")
LAYER_PREFIX = re.compile(r"^language_model\.model\.layers\.(\d+)\.")
# written as it goes: consecutive decoder layers share a file up to this size (a layer is never split), so at most
# one file's tensors are held (and the embedding and lm_head, whose file closes with the final norm)
SHARD_BYTES = 2 * 1024**3
# routed experts are packed to INT4 in stacks of about this many bf16 bytes (packing works row by row: exact)
EXPERT_STACK_BYTES = 256 * 1024**2
# weights: trained_like (TrainedLike): what the gates are sensitive to, shaped as trained LLMs have it
OUTLIER_CHANNELS = 4  # hidden dimensions carrying the large activations
OUTLIER_RATIO = 300.0  # their size as layer 0 writes them, in typical channels of its MLP output
OUTLIER_UNITS = 16  # dense-MLP units of layer 0 that write them (their mean keeps the sign fixed for every token)
OUTLIER_UNIT_LOGIT = 4.0  # those units' pre-activation spread on a unit-RMS input
CALIBRATION_TOKENS = 64  # unit-RMS inputs on which layer 0's typical MLP output is measured
ROUTER_LOGIT_STD = 1.0  # the router logits' spread over experts on a unit-RMS input (an assumption: see docstring)
REALISM_SEED = 0x4B32  # added to target.build.seed: TrainedLike's own draws leave the random ones unchanged


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A tensor as a freshly initialized model has it: norms 1 (biases 0), the router's correction bias small and fp32
    (as released), linear weights normal(0, 0.02); lm_head 8x larger, so that the target has confident, learnable
    preferences (as tiny.py's targets do). Drawn on the generator's device (the same draws on CPU as ever)."""
    import torch

    device = generator.device
    if name.endswith("e_score_correction_bias"):
        return (torch.rand(shape, generator=generator, device=device) * 0.05).float()
    if "norm" in name.rpartition(".")[0].rpartition(".")[2]:  # input_layernorm, norm0, pre_norm, ...
        fill = 0.0 if name.endswith(".bias") else 1.0
        return torch.full(shape, fill, dtype=torch.bfloat16, device=device)
    std = 0.16 if name.endswith("lm_head.weight") else 0.02
    return (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16)


class TrainedLike:
    """``weights: trained_like``: the random tensors reshaped where the gates are sensitive (module docstring). Its
    own draws come from a CPU generator seeded apart (seed + REALISM_SEED), so the channels chosen do not depend on
    the device and the random draws stay those of ``weights: random``."""

    def __init__(self, hidden: int, seed: int) -> None:
        import torch

        self.hidden = hidden
        self.generator = torch.Generator().manual_seed(seed + REALISM_SEED)
        self.channels = sorted(torch.randperm(hidden, generator=self.generator)[:OUTLIER_CHANNELS].tolist())
        signs = torch.randint(0, 2, (OUTLIER_CHANNELS,), generator=self.generator) * 2 - 1
        self.signs = [float(sign) for sign in signs]

    def shape(self, tensors: dict[str, torch.Tensor]) -> None:
        """Reshape, in place, the tensors of one group (one decoder layer, or one tensor outside the layers)."""
        for name in list(tensors):
            match = LAYER_PREFIX.match(name)
            after_layer_0 = match is not None and int(match.group(1)) > 0  # layer 0's MLP writes the outliers
            if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) and after_layer_0:
                tensors[name] = self.norm(tensors[name])
            elif name == "language_model.model.norm.weight":
                tensors[name] = self.norm(tensors[name])
            elif name.endswith("mlp.gate.weight"):
                tensors[name] = self.router(tensors[name])
        prefix = "language_model.model.layers.0.mlp."
        if prefix + "down_proj.weight" in tensors:
            self.write_outliers(tensors, prefix)

    def norm(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm after the outliers appear: its outlier channels weighted 1/R, so that they come out of it no larger
        than the rest (trained models' norm weights there are small); the other channels keep weight 1, so the norm
        shrinks them by the outliers' share of the RMS, as it does in a trained model."""
        out = weight.clone()
        out[self.channels] = 1 / OUTLIER_RATIO
        return out

    def router(self, weight: torch.Tensor) -> torch.Tensor:
        """Router rows rescaled (the same draws) so that the logits spread ROUTER_LOGIT_STD over the experts on a
        unit-RMS input, at any width (normal(0, 0.02) rows spread 0.02 sqrt(H): 1.7 at 7168, 0.23 at 128)."""
        return (weight.float() * (ROUTER_LOGIT_STD / (0.02 * math.sqrt(weight.shape[1])))).to(weight.dtype)

    def write_outliers(self, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        """Layer 0's dense MLP writes the outlier channels: OUTLIER_UNITS of its units get the same gate and up row
        (their output z^2 sigmoid(z) >= 0 for every token), and their down-projection columns write only the outlier
        channels, scaled so that these come out OUTLIER_RATIO times the median channel of the other units' output
        (measured on CALIBRATION_TOKENS unit-RMS inputs: what post_attention_layernorm hands the MLP)."""
        import torch

        gate, up, down = (tensors[prefix + f"{p}_proj.weight"] for p in ("gate", "up", "down"))
        device, inner = down.device, down.shape[1]
        units = torch.randperm(inner, generator=self.generator)[:OUTLIER_UNITS].to(device)
        rows = torch.randn(OUTLIER_UNITS, self.hidden, generator=self.generator) * (
            OUTLIER_UNIT_LOGIT / math.sqrt(self.hidden)
        )
        rows = rows.to(device=device, dtype=gate.dtype)
        gate[units], up[units] = rows, rows
        x = torch.randn(CALIBRATION_TOKENS, self.hidden, generator=self.generator).to(device)
        act = torch.nn.functional.silu(x @ gate.float().T) * (x @ up.float().T)  # [T, inner]
        others = torch.ones(inner, dtype=torch.bool, device=device)
        others[units] = False
        typical = (act[:, others] @ down.float()[:, others].T).abs().median()
        drive = act[:, units].sum(dim=-1).mean()
        column = torch.zeros(self.hidden, device=device)
        column[self.channels] = torch.tensor(self.signs, device=device) * (OUTLIER_RATIO * typical / drive)
        down[:, units] = column[:, None].to(down.dtype)


def quantized_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routed experts' ``<module>.weight`` tensors as the INT4 release stores them: weight_packed / weight_scale /
    weight_shape, by compressed-tensors' compressor (reference.compressed_weights.pack_int4_group). A layer's experts of one
    projection are packed as one stacked matrix and split by rows again: int4 group quantization and packing work row
    by row, so that is exact, and 8x faster than one call per expert. weight_shape as int32, the release's dtype (the
    library writes int64; vLLM and the library read either)."""
    import torch

    from eagle3_workflow.reference.compressed_weights import pack_int4_group

    stacks: dict[str, list[str]] = {}
    for name in sorted(tensors, key=_expert_order):
        stacks.setdefault(EXPERT_NUMBER.sub(".experts.*.", name), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for names in stacks.values():
        weights = [tensors[name] for name in names]
        packed = pack_int4_group(torch.cat(weights), GROUP_SIZE)
        rows = [w.shape[0] for w in weights]
        for name, weight, packed_rows, scale_rows in zip(
            names, weights, packed["weight_packed"].split(rows), packed["weight_scale"].split(rows), strict=True
        ):
            module = name.removesuffix(".weight")
            out[f"{module}.weight_packed"] = packed_rows.contiguous()
            out[f"{module}.weight_scale"] = scale_rows.contiguous()
            out[f"{module}.weight_shape"] = torch.tensor(weight.shape, dtype=torch.int32)
    return out


def _expert_order(name: str) -> tuple[str, int]:
    match = EXPERT_NUMBER.search(name)
    return (EXPERT_NUMBER.sub(".experts.*.", name), int(match.group(1)) if match else -1)


def stored_bytes(name: str, shape: tuple[int, ...], *, quantized: bool) -> int:
    """Bytes `name` takes in the checkpoint (a routed expert packed: int4 values, bf16 scales, its int32 shape)."""
    count = math.prod(shape)
    if quantized and is_routed_expert(name):
        return count // 2 + count // GROUP_SIZE * 2 + 8
    return count * (4 if name.endswith("e_score_correction_bias") else 2)


def groups_in_order(names: Iterable[str]) -> list[list[str]]:
    """The names in sorted order (the order of the random draws), cut into groups: one decoder layer's names (they
    are contiguous in that order), or one name outside the layers."""
    groups: list[list[str]] = []
    last: str | None = None
    for name in sorted(names):
        match = LAYER_PREFIX.match(name)
        key = match.group(0) if match else name
        if key != last or not match:
            groups.append([])
        groups[-1].append(name)
        last = key
    return groups


def shard_plan(shapes: Mapping[str, tuple[int, ...]], *, quantized: bool) -> dict[str, str]:
    """name -> file, the release's arrangement: decoder layers first (consecutive layers, in draw order, share a file
    up to SHARD_BYTES), then the embedding, final norm and lm_head, then the vision tower and projector."""
    layers: list[list[str]] = [[]]
    size = 0
    rest, vision = [], []
    for group in groups_in_order(shapes):
        if not LAYER_PREFIX.match(group[0]):
            (vision if group[0].startswith(("vision_tower.", "mm_projector.")) else rest).extend(group)
            continue
        nbytes = sum(stored_bytes(name, shapes[name], quantized=quantized) for name in group)
        if layers[-1] and size + nbytes > SHARD_BYTES:
            layers.append([])
            size = 0
        layers[-1].extend(group)
        size += nbytes
    files = [names for names in [*layers, rest, vision] if names]
    return {
        name: f"model-{number:05d}-of-{len(files):05d}.safetensors"
        for number, names in enumerate(files, start=1)
        for name in names
    }


class ShardWriter:
    """Saves each file of a shard plan as soon as every tensor planned for it has come (tensors on the CPU), then
    drops them; finish() writes model.safetensors.index.json."""

    def __init__(self, out_dir: Path, plan: Mapping[str, str]) -> None:
        self.out_dir, self.plan = out_dir, plan
        self.waiting: dict[str, set[str]] = {}
        for name, file in plan.items():
            self.waiting.setdefault(file, set()).add(name)
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, source: str, stored: Mapping[str, torch.Tensor]) -> None:
        """The tensors stored for the planned name `source` (itself, or a routed expert's packed triple)."""
        from safetensors.torch import save_file

        file = self.plan[source]
        self.held.setdefault(file, {}).update({name: t.cpu().contiguous() for name, t in stored.items()})
        self.waiting[file].discard(source)
        if self.waiting[file]:
            return
        tensors = self.held.pop(file)
        save_file(tensors, str(self.out_dir / file), metadata={"format": "pt"})
        self.weight_map |= dict.fromkeys(tensors, file)
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def finish(self) -> int:
        unwritten = sorted(file for file, names in self.waiting.items() if names)
        if unwritten:
            raise RuntimeError(f"shards never completed: {unwritten}")
        write_weight_index(self.out_dir, self.weight_map, self.total)
        return len(self.weight_map)


def write_weights(
    out_dir: Path,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    seed: int,
    quantized: bool,
    weights: str,
    device: str | None = None,
) -> int:
    """Random tensors of `shapes` (one generator on `device`, name order: deterministic for a seed and a device
    type), reshaped by TrainedLike when `weights` is trained_like, the routed experts packed when `quantized` (in
    stacks, on `device`), written shard by shard as each completes (shard_plan) with model.safetensors.index.json:
    never the whole model in memory. Returns the number of tensors written."""
    import torch

    generator = torch.Generator(device=device or "cpu").manual_seed(seed)  # None: the CPU
    hidden = shapes["language_model.model.norm.weight"][0]
    realism = TrainedLike(hidden, seed) if weights == "trained_like" else None
    writer = ShardWriter(out_dir, shard_plan(shapes, quantized=quantized))
    for group in groups_in_order(shapes):
        plain: dict[str, torch.Tensor] = {}
        experts: dict[str, torch.Tensor] = {}
        for name in group:
            tensor = random_tensor(name, shapes[name], generator)
            if not (quantized and is_routed_expert(name)):
                plain[name] = tensor
                continue
            experts[name] = tensor
            if sum(t.numel() * 2 for t in experts.values()) >= EXPERT_STACK_BYTES:
                _write_packed(writer, experts)
        _write_packed(writer, experts)
        if realism is not None:
            realism.shape(plain)
        for name, tensor in plain.items():
            writer.add(name, {name: tensor})
    return writer.finish()


def _write_packed(writer: ShardWriter, experts: dict[str, torch.Tensor]) -> None:
    """Pack the buffered routed experts and hand them to the writer; the buffer is emptied."""
    if not experts:
        return
    packed = quantized_experts(experts)
    for name in experts:
        module = name.removesuffix(".weight")
        writer.add(name, {f"{module}.{part}": packed[f"{module}.{part}"] for part in PACKED_PARTS})
    experts.clear()


def check_shape(shape: KimiShape) -> None:
    """Stop a target.build the stand-in cannot be built from, saying which key to set to what."""
    if shape.hidden_size < MIN_HIDDEN:
        raise StageError(
            f"target.build.hidden_size is {shape.hidden_size}; the kimi_k25 stand-in needs at least {MIN_HIDDEN} "
            f"(MLA heads of {shape.head_dim} + {QK_ROPE_HEAD_DIM}, experts of hidden/2 in int4 groups of "
            f"{GROUP_SIZE}). Fix: set target.build.hidden_size: {MIN_HIDDEN} (or more, a multiple of 64)"
        )
    if shape.hidden_size % 64:
        raise StageError(
            f"target.build.hidden_size is {shape.hidden_size}; the kimi_k25 stand-in needs a multiple of 64 "
            f"(its experts' width hidden/2 is packed in int4 groups of {GROUP_SIZE}). Fix: set it to "
            f"{shape.hidden_size // 64 * 64 or MIN_HIDDEN}"
        )
    width = shape.moe_intermediate_size
    if width is not None and width % GROUP_SIZE:
        raise StageError(
            f"target.build.moe_intermediate_size is {width}; the kimi_k25 stand-in needs a multiple of {GROUP_SIZE} "
            f"(each expert's down projection is packed in int4 groups of {GROUP_SIZE} along it; Marlin's MoE kernels "
            f"on the GPU want a multiple of 64). Fix: set it to {max(64, width // 64 * 64)}"
        )
    if shape.experts_per_token >= shape.routed_experts:
        raise StageError(
            f"target.build.experts_per_token is {shape.experts_per_token} of {shape.routed_experts} routed experts: "
            f"that is no routing. Fix: set experts_per_token below routed_experts (Kimi-K2.5: 8 of 384)"
        )


def build_kimi_k25_target(
    out_dir: Path, corpus_files: list[Path], shape: KimiShape, *, device: str | None = None
) -> Path:
    """The stand-in of `shape` (target.build) in `out_dir`, with a tokenizer trained on `corpus_files`; its weights
    drawn (and its experts packed) on `device` (None: the CPU; "cuda" on a GPU machine: the real width in minutes)."""
    check_shape(shape)
    quantized = shape.quantization == "int4"
    tokenizer = build_tokenizer(corpus_files, shape.vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": [*MEDIA_TOKENS, VIDEO_PLACEHOLDER]})
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")}
    rows = shape.padded_vocab_size or len(tokenizer)
    if rows < len(tokenizer):
        raise StageError(
            f"target.build.padded_vocab_size is {rows}, fewer rows than the tokenizer's {len(tokenizer)} tokens. Fix: "
            f"set it to at least {len(tokenizer)}, or null"
        )
    text = text_config(
        shape,
        vocab_size=rows,
        bos=ids["<|begin_of_text|>"],
        eos=ids["<|im_end|>"],
        pad=ids["<|pad|>"],
        quantized=quantized,
    )
    config = model_config(text, media_pad=tokenizer.convert_tokens_to_ids("<|media_pad|>"))
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = text_shapes(text) | vision_shapes(config["vision_config"], text["hidden_size"])
    started = time.monotonic()
    count = write_weights(out_dir, shapes, seed=shape.seed, quantized=quantized, weights=shape.weights, device=device)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    generation = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
                  "pad_token_id": text["pad_token_id"]}  # fmt: skip
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(out_dir)
    share_as_umask_allows(out_dir)
    log.info(
        "built the Kimi-K2.5 stand-in (%s, %s weights, drawn on %s): %d layers, hidden %d, %d heads, %d routed "
        "experts of width %d (top %d) + 1 shared, vocab %d (tokenizer %d), vision %d x %d, %d tensors, %.1f GB in "
        "%.0f s -> %s",
        "INT4 routed experts" if quantized else "bf16",
        shape.weights,
        device,
        text["num_hidden_layers"],
        text["hidden_size"],
        text["num_attention_heads"],
        text["n_routed_experts"],
        text["moe_intermediate_size"],
        text["num_experts_per_tok"],
        rows,
        len(tokenizer),
        VISION["layers"],
        VISION["hidden"],
        count,
        sum(stored_bytes(n, shapes[n], quantized=quantized) for n in shapes) / 1e9,
        time.monotonic() - started,
        out_dir,
    )
    return out_dir
