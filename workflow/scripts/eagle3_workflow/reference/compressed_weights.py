"""Compressed-tensors checkpoints read as plain fp32 weights: the scheme a checkpoint's quantization_config declares
(`read_scheme`, `describe_scheme`), the dequantization of one decoder layer's tensors (`dequantize`), and the packing
the tiny INT4 stand-in is built with (`pack_int4_group`).

Why: the fp32 references (the full-depth proof, the canary's) must run the quantized target that vLLM serves, e.g.
Kimi-K2.5 INT4 (routed experts in pack-quantized int4, group 32). Every bit of the unpacking and of the scale
arithmetic is the compressed-tensors library's own (its compressors' decompress, as its model-free dequantizer
`CompressedTensorsDequantizer` runs them; `calculate_qparams` and its compressors' compress for packing): nothing
here re-implements a bit layout that could drift from the one vLLM reads.

Formats read (FORMATS_READ): ``pack-quantized`` and ``naive-quantized`` (also ``int-quantized``), INT weights of
1..8 bits, symmetric or asymmetric, strategy tensor, channel or group, weight-only (no activation quantization).
Everything else (fp8 / nvfp4 / mxfp4 / marlin-24 / sparse formats, activation-order group indices, quantized
activations) is refused with UnsupportedScheme naming the format and the fix. The dequantization is done in fp32
(the stored bf16 scales widened first): q * scale is exact in fp32 for up to 8-bit q and bf16 scales.

Pure: torch and compressed_tensors, imported when first used (no transformers, no file access).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from eagle3_workflow.reference.target_config import text_section
from eagle3_workflow.settings.errors import StageError

if TYPE_CHECKING:
    import torch

METHOD = "compressed-tensors"
FORMATS_READ = ("pack-quantized", "naive-quantized", "int-quantized")
STRATEGIES_READ = ("tensor", "channel", "group")
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
READ = (
    "compressed-tensors pack-quantized or naive-quantized, INT weights of 1..8 bits, symmetric or asymmetric, "
    "strategy tensor/channel/group, weight-only"
)
FIX = (
    "point target.path at a bf16 copy of the same model (or one stored in a format read), or extend "
    "eagle3_workflow.reference.compressed_weights with compressed-tensors' compressor for this format"
)


class UnsupportedScheme(StageError):
    """The checkpoint's quantization is not one the fp32 reference reads; `reason` says which, and what is read."""

    def __init__(self, detail: str) -> None:
        self.reason = f"{detail} (the fp32 reference reads {READ})"
        self.fix = FIX
        super().__init__(f"{self.reason}. Fix: {FIX}")


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """One config group of the quantization_config: which modules (targets) and how their weights are stored."""

    name: str
    format: str  # the compressor: pack-quantized, naive-quantized, ...
    num_bits: int
    type: str  # int
    symmetric: bool
    strategy: str  # tensor, channel, group
    group_size: int | None
    targets: tuple[str, ...]

    def describe(self) -> str:
        symmetry = "symmetric" if self.symmetric else "asymmetric"
        strategy = f"group {self.group_size}" if self.strategy == "group" else self.strategy
        return f"{self.format} {self.type}{self.num_bits} {symmetry} {strategy}"


@dataclasses.dataclass(frozen=True)
class QuantizedCheckpoint:
    """What a compressed-tensors quantization_config declares, and where config.json keeps it."""

    where: str  # "config.json's text_config" or "config.json's top level"
    groups: tuple[WeightScheme, ...]
    ignore: tuple[str, ...]
    raw: Mapping[str, Any]  # the quantization_config as stored, for compressed_tensors' QuantizationConfig

    def quantization_config(self) -> Any:
        """compressed_tensors' QuantizationConfig of the checkpoint, each group's format filled in."""
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig.model_validate(dict(self.raw))
        for name, scheme in config.config_groups.items():
            scheme.format = self.group(name).format
        return config

    def group(self, name: str) -> WeightScheme:
        return next(group for group in self.groups if group.name == name)


# ------------------------------------------------------------------------------------------------ the scheme


def quantization_section(config: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str]:
    """(quantization_config, where) of a config.json dict: at the top level, or inside ``text_config`` (Kimi-K2.5's
    place for it; vLLM's config class copies it up). (None, "") when the checkpoint is not quantized."""
    if config.get("quantization_config"):
        return config["quantization_config"], "config.json's top level"
    text = text_section(config)  # the config itself when it has no text_config
    if text is not config and isinstance(text, Mapping) and text.get("quantization_config"):
        return text["quantization_config"], "config.json's text_config"
    return None, ""


def read_scheme(config: Mapping[str, Any]) -> QuantizedCheckpoint | None:
    """The compressed-tensors scheme of a config.json dict; None when it declares no quantization. UnsupportedScheme
    for another quantization method or a format / scheme outside FORMATS_READ (the reason names it)."""
    section, where = quantization_section(config)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise UnsupportedScheme(f"the quantization_config in {where} is a {type(section).__name__}, not an object")
    method = section.get("quant_method")
    head = f"the checkpoint is quantized ({method}), its quantization_config in {where}"
    if method != METHOD:
        raise UnsupportedScheme(f"{head}: quant_method {method!r} is not {METHOD}")
    from compressed_tensors.quantization import QuantizationConfig

    try:
        parsed = QuantizationConfig.model_validate(dict(section))
    except Exception as exc:  # noqa: BLE001 - pydantic's refusal, quoted
        raise UnsupportedScheme(f"{head}: compressed-tensors cannot read it ({exc!r})") from exc
    if getattr(parsed, "sparsity_config", None) or section.get("sparsity_config"):
        raise UnsupportedScheme(f"{head}: it is also sparse-compressed")
    groups = [weight_scheme(name, scheme, section, head) for name, scheme in sorted(parsed.config_groups.items())]
    if not groups:
        raise UnsupportedScheme(f"{head}: it has no config_groups")
    return QuantizedCheckpoint(where=where, groups=tuple(groups), ignore=tuple(parsed.ignore or ()), raw=section)


def weight_scheme(name: str, scheme: Any, section: Mapping[str, Any], head: str) -> WeightScheme:
    """One config group of a parsed QuantizationConfig as the WeightScheme it declares; UnsupportedScheme (after
    `head`, which names the checkpoint's section) when it is outside FORMATS_READ / STRATEGIES_READ."""
    from compressed_tensors.compressors.format import infer_module_format

    weights = scheme.weights
    if weights is None:
        raise UnsupportedScheme(f"{head}: config group {name!r} quantizes no weights")
    fmt = scheme.format or section.get("format")
    if fmt in (None, "mixed-precision"):
        import torch

        fmt = infer_module_format(torch.nn.Linear, scheme)
    fmt = str(getattr(fmt, "value", fmt))
    group = WeightScheme(
        name=name,
        format=fmt,
        num_bits=int(weights.num_bits),
        type=str(getattr(weights.type, "value", weights.type)),
        symmetric=bool(weights.symmetric),
        strategy=str(getattr(weights.strategy, "value", weights.strategy)),
        group_size=weights.group_size,
        targets=tuple(scheme.targets),
    )
    problem = (
        f"format {fmt!r} is not read"
        if fmt not in FORMATS_READ
        else f"weights of type {group.type} are not read"
        if group.type != "int" or not 1 <= group.num_bits <= 8
        else f"strategy {group.strategy!r} is not read"
        if group.strategy not in STRATEGIES_READ
        else "activation-order group indices (actorder) are not read"
        if weights.actorder
        else "quantized activations are not reproduced by an fp32 reference"
        if scheme.input_activations is not None or scheme.output_activations is not None
        else ""
    )
    if problem:
        raise UnsupportedScheme(f"{head}: config group {name!r} ({group.describe()}): {problem}")
    return group


LAYER_OR_EXPERT = re.compile(r"\.\d+\.")


def quantized_modules(names: Iterable[str]) -> list[str]:
    """The kinds of module stored quantized (a `<module>.weight_packed` or `.weight_scale` in `names`), layer and
    expert numbers as '*': ["model.layers.*.mlp.experts.*.down_proj", ...]."""
    kinds = set()
    for name in names:
        module, _, param = name.rpartition(".")
        if param in ("weight_packed", "weight_scale"):
            kinds.add(LAYER_OR_EXPERT.sub(".*.", LAYER_OR_EXPERT.sub(".*.", module)))
    return sorted(kinds)


def describe_scheme(checkpoint: QuantizedCheckpoint, names: Iterable[str] = ()) -> str:
    """One line for check_api: "compressed-tensors pack-quantized int4 symmetric group 32 (routed experts; 23 ignore
    patterns; in text_config)". `names` (the checkpoint's tensor names) say which modules are quantized."""
    kinds = quantized_modules(names)
    details = []
    if kinds:
        if all(".mlp.experts.*." in kind for kind in kinds):
            details.append("routed experts")
        else:
            short = sorted({kind.rpartition(".*.")[2] for kind in kinds})
            details.append("quantized: " + ", ".join(short[:6]) + (", ..." if len(short) > 6 else ""))
    details.append(f"{len(checkpoint.ignore)} ignore pattern{'s' if len(checkpoint.ignore) != 1 else ''}")
    details.append(f"in {checkpoint.where}")
    schemes = " + ".join(dict.fromkeys(group.describe() for group in checkpoint.groups))
    return f"{METHOD} {schemes} ({'; '.join(details)})"


# ------------------------------------------------------------------------------------------------ dequantization


def quantized_parts(names: Iterable[str], checkpoint: QuantizedCheckpoint) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Module -> (its config group, the names of its stored tensors) for every module of `names` stored quantized,
    from the names alone (check_api's preflight runs it on the whole checkpoint without reading a tensor).
    UnsupportedScheme when a quantized module lacks a stored tensor its compressor needs, or when tensors are stored
    quantized but no config group claims their module (a quantization_config that does not describe its checkpoint).
    """
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.utils.match import match_quantizable_tensors

    config = checkpoint.quantization_config()
    left = dict.fromkeys(names)
    parts: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, scheme in config.config_groups.items():
        compressor = BaseCompressor.get_value_from_registry(checkpoint.group(name).format)
        params = tuple(compressor.compression_param_names(scheme))
        stored_as = params[0]  # weight_packed (pack-quantized) or weight (naive-quantized)
        matched = list(
            match_quantizable_tensors(left, ignore=config.ignore, targets=scheme.targets, param_targets=[stored_as])
        )
        for module, _ in matched:
            if stored_as == "weight" and f"{module}.weight_scale" not in left:
                continue  # a plain module among naive-quantized ones
            missing = [f"{module}.{param}" for param in params if f"{module}.{param}" not in left]
            if missing:
                raise UnsupportedScheme(
                    f"module {module} is stored quantized ({checkpoint.group(name).describe()}) but the checkpoint "
                    f"lacks {missing}"
                )
            for param in params:
                del left[f"{module}.{param}"]
            parts[module] = (name, params)
    stray = sorted(name for name in left if name.rpartition(".")[2] in PACKED_SUFFIXES)
    if stray:
        raise UnsupportedScheme(
            f"tensors {stray[:4]} are stored quantized but no config group of the quantization_config (in "
            f"{checkpoint.where}) claims their module (targets {[list(g.targets) for g in checkpoint.groups]}, "
            f"ignore {list(checkpoint.ignore)[:4]}...)"
        )
    return parts


def dequantize(tensors: Mapping[str, torch.Tensor], checkpoint: QuantizedCheckpoint) -> dict[str, torch.Tensor]:
    """The tensors of one decoder layer (or any set of whole modules) with every quantized module's stored tensors
    (``<module>.weight_packed``, ``.weight_scale``, ``.weight_shape``, ``.weight_zero_point``) replaced by its fp32
    ``<module>.weight``, computed by the library's compressor of the module's config group (its decompress, given
    the scales widened to fp32: q * scale exact); the other tensors as stored. UnsupportedScheme as
    `quantized_parts`, or when the library refuses a module's tensors."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor

    config = checkpoint.quantization_config()
    out = dict(tensors)
    for module, (group, params) in quantized_parts(tensors, checkpoint).items():
        state = {param: out.pop(f"{module}.{param}") for param in params}
        for key in ("weight_scale", "weight_zero_point"):
            if key in state and state[key].is_floating_point():
                state[key] = state[key].float()
        compressor = BaseCompressor.get_value_from_registry(checkpoint.group(group).format)
        try:
            weight = compressor.decompress(state, config.config_groups[group])["weight"]
        except Exception as exc:  # noqa: BLE001 - the library's refusal, quoted
            raise UnsupportedScheme(
                f"compressed-tensors cannot decompress {module} ({checkpoint.group(group).describe()}): {exc!r}"
            ) from exc
        out[f"{module}.weight"] = weight.to(torch.float32)
    return out


# ------------------------------------------------------------------------------------------------ packing


def int4_group_scheme(group_size: int) -> Any:
    """compressed_tensors' QuantizationScheme of Kimi-K2.5's routed experts: int4, symmetric, group, bf16 scales."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, scale_dtype=torch.bfloat16
    )
    return QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")


def int4_group_config(group_size: int, ignore: Iterable[str]) -> dict[str, Any]:
    """The quantization_config dict (config.json's) of `pack_int4_group`'s tensors, key for key as Kimi-K2.5 stores
    it (inside text_config there)."""
    weights = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group_size,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
    }
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": weights,
            }
        },
        "format": "pack-quantized",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": METHOD,
        "quantization_status": "compressed",
    }


def pack_int4_group(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A Linear weight [out, in] as Kimi-K2.5 stores a routed expert's: {"weight_packed": int32 [out, in/8],
    "weight_scale": bf16 [out, in/group_size], "weight_shape": int64 [2]}. Scales from the group's min/max by
    compressed-tensors' calculate_qparams (rounded to bf16 before quantizing, so the stored scale is the one used),
    quantized and packed by its PackedQuantizationCompressor.compress."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    if weight.ndim != 2 or weight.shape[1] % group_size:
        raise ValueError(f"a weight [out, in] with in divisible by {group_size} is needed, got {tuple(weight.shape)}")
    scheme = int4_group_scheme(group_size)
    grouped = weight.detach().float().reshape(weight.shape[0], -1, group_size)
    scale, zero_point = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme.weights)
    state = {"weight": weight.detach().float(), "weight_scale": scale.float(), "weight_zero_point": zero_point}
    packed = PackedQuantizationCompressor.compress(state, scheme)
    return {
        "weight_packed": packed["weight_packed"].contiguous(),
        "weight_scale": packed["weight_scale"].to(torch.bfloat16).contiguous(),
        "weight_shape": packed["weight_shape"].contiguous(),
    }
