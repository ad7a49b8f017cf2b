"""The fp32 reference of the WHOLE target, streamed one decoder layer at a time: what validate_hidden_states' full-depth
check compares every captured slot with (validation/full_depth.py), and what check_api's preflight builds before any
extraction (the decoder from the config, every layer's tensors in the checkpoint).

Memory of one layer: the model is built from its config on the meta device (no weights). Its embedding (kept in
the checkpoint's dtype: a lookup is exact) and final norm are read first; each decoder layer is read from the
safetensors files (safe_open, only that layer's tensors, the file closed again) just before its forward, converted
by transformers' own checkpoint conversion (DeepSeek's per-expert tensors become its fused experts, as in
from_pretrained) and freed right after. A compressed-tensors checkpoint (Kimi-K2.5's int4 routed experts) is read
the same way: each layer's stored tensors are dequantized to fp32 by compressed_weights (the library's own
decompression) before the conversion. A multimodal wrapper whose language model is stored under ``language_model.``
(Kimi-K2.5: ``language_model.model.layers.N...``, its config in ``text_config``) is run as that text model (the
reference of text-only samples); the vision tower's tensors are never read. The samples go through as ONE
right-padded batch, through HF's own model
forward (its causal + padding mask, its rotary embeddings), so the weights are read once: an 8B target runs on a
CPU node, a 1T MoE in the time of one read of its weights. Each reference state is handed to the caller's visit as it
streams by; none is kept. No vLLM here, no subprocess.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_workflow.files.target_weights import NotSafetensors, weight_files
from eagle3_workflow.reference import compressed_weights
from eagle3_workflow.reference.compressed_weights import QuantizedCheckpoint, UnsupportedScheme
from eagle3_workflow.reference.layer_match import LAYER_KEY, POST_NORM
from eagle3_workflow.reference.target_config import TEXT_PREFIX, read_target_config, read_tensors, text_weight_prefix
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.full_depth")

REFERENCE = "HF transformers fp32 forward of the whole target, streamed one decoder layer at a time"
TURN_OFF = (
    "set validation.full_depth_check: false only if you accept training on hidden states nobody compared with the "
    "target past the canary's slice (unsafe; recorded in validation.json and provenance.json)"
)
Visit = Callable[[str, torch.Tensor], None]


class UnsupportedTarget(StageError):
    """The streamed reference cannot run this checkpoint (architecture, quantization, tensor layout)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def unsupported(
    target_dir: Path, reason: str, fix: str = "a transformers that runs this architecture"
) -> UnsupportedTarget:
    return UnsupportedTarget(
        f"the full-depth check cannot run an fp32 reference of {target_dir}: {reason}. The hidden states are not "
        f"proven past the canary's slice. Fix: {fix}, or {TURN_OFF}",
        reason,
    )


# ------------------------------------------------------------------------------------------------ the checkpoint


def checkpoint_files(target_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it (files.target_weights.weight_files); UnsupportedTarget without
    safetensors."""
    try:
        return weight_files(target_dir)
    except NotSafetensors as exc:
        raise unsupported(target_dir, "it has neither model.safetensors nor model.safetensors.index.json") from exc


def split_by_layer(names: Sequence[str], num_layers: int) -> tuple[list[str], dict[int, list[str]]]:
    """The tensors outside the decoder layers (the output head left out: the reference stops at the final norm), and
    those of each layer 0..N-1. Layers numbered N and above (DeepSeek's multi-token-prediction layer) are not run."""
    outside: list[str] = []
    per_layer: dict[int, list[str]] = {k: [] for k in range(num_layers)}
    for name in sorted(names):
        match = LAYER_KEY.search(name)
        if match is None:
            if not name.startswith("lm_head."):
                outside.append(name)
        elif int(match.group(2)) < num_layers:
            per_layer[int(match.group(2))].append(name)
    return outside, per_layer


# ------------------------------------------------------------------------------------------------ the model skeleton


@dataclasses.dataclass
class Target:
    """The meta skeleton to run and how to read its weights: `files` maps the checkpoint's tensor names (as stored) to
    their safetensors file; a stored name is the skeleton's name with `prefix` in front (TEXT_PREFIX for a wrapper
    run as its text model, else ""); `quantized` is the compressed-tensors scheme found (None: plain weights)."""

    model: Any
    decoder: Any
    files: dict[str, str]
    prefix: str
    quantized: QuantizedCheckpoint | None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    def names(self) -> list[str]:
        """The skeleton's names of the checkpoint's tensors (those outside `prefix` left out: the vision tower)."""
        return [name.removeprefix(self.prefix) for name in self.files if name.startswith(self.prefix)]

    def read(self, target_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tensors `names` (skeleton names), as plain fp32/stored weights: quantized modules dequantized."""
        stored = read_tensors(target_dir, self.files, [self.prefix + name for name in names])
        # on the reference's device before dequantizing: on a GPU the int4 unpacking is its fastest part
        tensors = {name.removeprefix(self.prefix): tensor.to(self.device) for name, tensor in stored.items()}
        if self.quantized is None:
            return tensors
        try:
            return compressed_weights.dequantize(tensors, self.quantized)
        except UnsupportedScheme as exc:
            raise unsupported(target_dir, exc.reason, exc.fix) from exc

    def weights(self) -> str:
        """How the weights are stored, for check_api's row."""
        if self.quantized is None:
            return "plain weights (not quantized)"
        return compressed_weights.describe_scheme(self.quantized, self.names())


def quantization(target_dir: Path) -> QuantizedCheckpoint | None:
    """The compressed-tensors scheme config.json declares (top level or text_config), None for plain weights;
    UnsupportedTarget for a quantization the reference does not read (reference.compressed_weights.FORMATS_READ)."""
    try:
        raw = read_target_config(target_dir).raw
    except StageError as exc:
        raise unsupported(target_dir, f"its config.json cannot be read ({exc!r})") from exc
    try:
        return compressed_weights.read_scheme(raw)
    except UnsupportedScheme as exc:
        raise unsupported(target_dir, exc.reason, exc.fix) from exc


def without_quantization(config: Any) -> Any:
    """The config with quantization_config removed (top level and text config), so that from_config builds plain
    modules: the reference loads dequantized fp32 weights into them."""
    for section in (config, config.get_text_config()):
        if getattr(section, "quantization_config", None) is not None:
            delattr(section, "quantization_config")
    return config


def open_target(target_dir: Path, *, trust_remote_code: bool) -> Target:
    """The skeleton (built_skeleton) and the way to read its weights. A config with a separate text config whose
    checkpoint stores the decoder under TEXT_PREFIX ("language_model.model.layers.N...") is run as that text model."""
    quantized = quantization(target_dir)
    files = checkpoint_files(target_dir)
    prefix = text_weight_prefix(files)
    model, decoder = build_skeleton(target_dir, trust_remote_code=trust_remote_code, text_model=bool(prefix))
    target = Target(model=model, decoder=decoder, files=files, prefix=prefix, quantized=quantized)
    if quantized is not None:
        try:
            compressed_weights.quantized_parts(target.names(), quantized)
        except UnsupportedScheme as exc:
            raise unsupported(target_dir, exc.reason, exc.fix) from exc
    return target


def build_skeleton(target_dir: Path, *, trust_remote_code: bool, text_model: bool = False) -> tuple[Any, Any]:
    """(model, its decoder) built from the config with every weight on the meta device (no memory); `text_model`:
    from the config's text config (a wrapper's language model alone). Any quantization_config is
    left out (the weights are dequantized before loading). The buffers that are computed rather than stored (rotary
    inverse frequencies) are computed, as from_pretrained does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any refusal is reported with its cause
        raise unsupported(target_dir, f"transformers cannot read its config ({exc!r})") from exc
    config = without_quantization(config)
    if text_model and config.get_text_config() is config:
        raise unsupported(target_dir, f"its decoder is stored under {TEXT_PREFIX!r} but its config has no text_config")
    if text_model:
        text = config.get_text_config()
        # Kimi-K2.5's text_config says model_type "kimi_k2", read as a DeepseekV3Config that keeps the name: under it
        # transformers finds no checkpoint conversion (the per-expert tensors would not fuse into its experts)
        text.model_type = type(text).model_type or text.model_type
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config.get_text_config() if text_model else config,
                dtype=torch.float32,
                trust_remote_code=trust_remote_code,
            )
        decoder = model.get_decoder()
        layers, _ = decoder.layers, decoder.norm  # the decoder layers and the final norm the reference hooks
    except Exception as exc:  # noqa: BLE001
        what = "its text config" if text_model else "the config"
        raise unsupported(target_dir, f"transformers cannot build its decoder from {what} ({exc!r})") from exc
    model.eval()
    owners = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    for owner in sorted(owners):
        module = model.get_submodule(owner)
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)  # what from_pretrained runs for buffers a checkpoint lacks
    left = [name for name, buffer in model.named_non_persistent_buffers() if buffer.is_meta]
    if left:
        raise unsupported(target_dir, f"buffers {left} could not be computed outside from_pretrained")
    if len(layers) != int(decoder.config.num_hidden_layers):
        raise unsupported(target_dir, f"its decoder has {len(layers)} layers, its config says otherwise")
    return model, decoder


def weight_bytes(module: Any, *, skip: str | None = None) -> int:
    """Bytes of a module's loaded weights (parameters and buffers; names under `skip.` not counted)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in tensors if not (skip and name.startswith(skip + ".")))


def preflight(target_dir: Path, *, trust_remote_code: bool) -> str:
    """What check_api runs before any extraction: transformers builds the decoder from the config (no weights), the
    checkpoint holds tensors of every decoder layer, and a quantized checkpoint's scheme is one the reference reads,
    its stored tensors complete (from their names). Raises UnsupportedTarget; returns what it found, the
    quantization scheme included."""
    target = open_target(target_dir, trust_remote_code=trust_remote_code)
    layers = target.decoder.layers
    _, per_layer = split_by_layer(target.names(), len(layers))
    empty = [index for index, names in per_layer.items() if not names]
    if empty:
        raise unsupported(target_dir, f"its checkpoint has no tensor of decoder layers {empty[:8]}")
    text = f" (the text model, tensors under {target.prefix!r})" if target.prefix else ""
    return (
        f"{type(target.model).__name__}{text}: {len(layers)} layers, {len(set(target.files.values()))} safetensors "
        f"file(s); {target.weights()}"
    )


def load_module(
    model: Any,
    module: Any,
    tensors: dict[str, torch.Tensor],
    what: str,
    *,
    skip: str | None = None,
    device: torch.device | None = None,
) -> int:
    """Load checkpoint `tensors` into `module` of the meta `model` through transformers' own conversion (renames,
    fused experts), in the skeleton's dtype (fp32). Returns the bytes now held; refuses when any weight of `module`
    (but those under `skip.`, loaded later) stays unloaded."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    # dtype None: each tensor takes the dtype of the skeleton's parameter (fp32; the embedding: keep_stored_dtype);
    # every weight placed on the reference's device (transformers' device_map, one device for all)
    placed = {"": device if device is not None else torch.device("cpu")}
    config = LoadStateDictConfig(dtype=None, weight_mapping=get_model_conversion_mapping(model), device_map=placed)
    info, _ = convert_and_load_state_dict_in_model(model=model, state_dict=tensors, load_config=config)
    problems = [
        f"{label} {sorted(keys)[:5]}"
        for label, keys in (
            ("unexpected tensors", info.unexpected_keys),
            ("tensors of the wrong shape", info.mismatched_keys),
            ("conversion errors", info.conversion_errors),
            ("errors", info.error_msgs),
        )
        if keys
    ]
    unloaded = [
        name
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if tensor.is_meta and not (skip and name.startswith(skip + "."))
    ]
    if unloaded:
        problems.append(f"weights not in the checkpoint {unloaded[:5]}")
    if problems:
        reason = f"{what}: its tensors do not load into transformers' {type(module).__name__}: {'; '.join(problems)}"
        raise UnsupportedTarget(f"{reason}. The full-depth reference cannot run this checkpoint; {TURN_OFF}", reason)
    return weight_bytes(module, skip=skip)


def keep_stored_dtype(embed: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """The input embedding stays in the checkpoint's dtype (a lookup is exact in any dtype; its rows become fp32 after
    the lookup): a 128k-token vocabulary in fp32 would be twice the memory of an 8B model's layer."""
    shape = tuple(embed.weight.shape)
    stored = [t.dtype for t in tensors.values() if tuple(t.shape) == shape]
    if stored and stored[0].is_floating_point:
        embed.to(dtype=stored[0])


def free(module: Any) -> None:
    """Give a module's weights back (to the meta device): memory returns to one layer."""
    module.to("meta")


# ------------------------------------------------------------------------------------------------ the forward


def right_padded(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] input ids and attention mask, samples left-aligned (causal attention never sees the padding)."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, ids in enumerate(batch):
        input_ids[b, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        mask[b, : len(ids)] = 1
    return input_ids, mask


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" bar, once per layer, would bury the stage's own progress lines."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class LayerStream:
    """The forward hooks that stream a target through one decoder layer at a time: each layer's tensors read just
    before its forward and freed right after it, every depth handed to `visit`, the weight bytes held counted."""

    def __init__(self, target: Target, target_dir: Path, visit: Visit) -> None:
        self.target, self.target_dir, self.visit = target, target_dir, visit
        self.layers = target.decoder.layers
        self.num_layers = len(self.layers)
        # each layer's tensors read (and dequantized, if stored quantized) just before its forward
        self.outside, self.per_layer = split_by_layer(target.names(), self.num_layers)
        self.now = self.peak = 0
        self.started = time.monotonic()

    def handed(self, label: str, states: torch.Tensor) -> None:
        """`visit` gets every depth on the CPU, whatever device the reference runs on (the comparisons are there)."""
        self.visit(label, states.to("cpu"))

    def hold(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def before_layer(self, index: int) -> Callable[..., None]:
        def hook(_module: Any, args: tuple, kwargs: dict) -> None:
            if not self.per_layer[index]:
                raise unsupported(self.target_dir, f"its checkpoint has no tensor of decoder layer {index}")
            tensors = self.target.read(self.target_dir, self.per_layer[index])
            what = f"decoder layer {index}"
            self.hold(load_module(self.target.model, self.layers[index], tensors, what, device=self.target.device))
            self.handed(str(index), args[0] if args else kwargs["hidden_states"])

        return hook

    def after_layer(self, index: int) -> Callable[..., None]:
        def hook(module: Any, _args: tuple, output: Any) -> None:
            last = self.num_layers - 1
            if index == last:
                self.handed(str(self.num_layers), _first_tensor(output))
            nbytes = weight_bytes(module)
            free(module)
            self.now -= nbytes
            if (index + 1) % max(1, self.num_layers // 8) == 0 or index == last:
                elapsed = time.monotonic() - self.started
                log.info("full-depth reference: %d/%d layers, %.1f s", index + 1, self.num_layers, elapsed)

        return hook

    def after_embedding(self, module: Any, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        self.now -= weight_bytes(module)
        free(module)  # a large vocabulary's embedding is as big as a layer: not kept beside them
        return output.float()  # rows of the stored dtype, exactly; from here on everything is fp32

    def install(self) -> list[Any]:
        """Every hook on the target's modules; the handles, to remove."""
        decoder = self.target.decoder
        hooks = [decoder.get_input_embeddings().register_forward_hook(self.after_embedding)]
        hooks.append(decoder.norm.register_forward_hook(lambda _m, _a, out: self.handed(POST_NORM, _first_tensor(out))))
        for index, layer in enumerate(self.layers):
            hooks.append(layer.register_forward_pre_hook(self.before_layer(index), with_kwargs=True))
            hooks.append(layer.register_forward_hook(self.after_layer(index)))
        return hooks


DEVICES = ("cpu", "cuda")


def reference_device(name: str) -> torch.device:
    """The device the reference runs on (config `reference.device`): cpu, or cuda where this process sees a GPU;
    StageError with the fix otherwise."""
    if name not in DEVICES:
        raise StageError(f"reference.device is {name!r}; it must be one of {list(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise StageError(
            "reference.device is cuda, but this process sees no CUDA device (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Fix: run "
            "the stage where a GPU is visible (its rule's gpu resources), or set reference.device: cpu"
        )
    return torch.device(name)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 matmuls and convolutions in full fp32 on a GPU (no TF32, whatever another library set): the reference is
    the fp32 forward the tolerances are derived against, on any device."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        torch.set_float32_matmul_precision(precision)


def place_computed_buffers(model: Any, device: torch.device) -> None:
    """The buffers build_skeleton computed on the CPU (rotary inverse frequencies) moved to `device`; the weights
    stay on the meta device until their layer is read."""
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def stream_reference(
    target_dir: Path,
    batch: Sequence[Sequence[int]],
    visit: Visit,
    *,
    trust_remote_code: bool,
    device: str,
    opened: Target | None = None,
) -> tuple[int, int]:
    """Run the fp32 HF forward of `batch` through the whole target, one decoder layer in memory at a time, and call
    ``visit(label, states)`` with states [B, T, H] for every depth in vLLM's convention: str(k), k in 0..N-1, the
    input of layer k; str(N) the pre-norm output of the last layer; POST_NORM the final norm's output. Positions
    past a sample's length are padding. Returns (N, the most weight bytes held at once). `opened`: the skeleton
    open_target already built for this folder (the canary builds it while its server starts), used once. `device`
    (config `reference.device`): where the layers run, cpu or cuda; the states reach `visit` on the CPU either way."""
    placed = reference_device(device)
    target = opened if opened is not None else open_target(target_dir, trust_remote_code=trust_remote_code)
    target.device = placed
    place_computed_buffers(target.model, placed)
    stream = LayerStream(target, target_dir, visit)
    decoder = target.decoder
    hooks = stream.install()
    input_ids, mask = (t.to(placed) for t in right_padded(batch, pad_id=0))
    if placed.type != "cpu":
        log.info("full-depth reference on %s (%s)", placed, torch.cuda.get_device_name(placed))
    try:
        with _quiet_loading(), exact_fp32():
            tensors = target.read(target_dir, stream.outside)
            keep_stored_dtype(decoder.get_input_embeddings(), tensors)
            what = "embedding and final norm"
            stream.hold(load_module(target.model, decoder, tensors, what, skip="layers", device=placed))
            del tensors
            with torch.inference_mode():
                decoder(input_ids=input_ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return stream.num_layers, stream.peak
