"""Whether a target's weights fit the GPUs a serving stage gives them, checked before any engine starts.

A target too large for its tensor-parallel size does not fail at once: vLLM loads shard after shard until a GPU is
full, and for the story's ~600 GB target that is minutes of loading before an out-of-memory error. The weights alone
are a lower bound of what a rank holds (activations, the KV cache and CUDA graphs come on top), so the rule refuses
only what cannot fit: the weights of one rank above the memory vLLM may take on one GPU.

- The weights: every tensor of the checkpoint's safetensors headers, floating-point ones at the serving dtype's
  width (vLLM casts an fp32 checkpoint to 16 bits), the others (packed INT4 as int32, fp8, int8) as stored. Split
  evenly over the ranks (tensor parallelism shards every layer; the embedding and lm_head are split too).
- The memory vLLM may take on one GPU: `gpu_memory_utilization` of it, or, where the KV cache is sized in bytes
  (`kv_cache_memory_bytes`), the whole GPU less that cache.
- The GPU: the smallest of the node's GPUs (nvidia-smi), read without touching CUDA in the stage's process. On the lent
  H100 nvidia-smi's figure is 480 MiB (0.59%) above what CUDA hands out (bench/gpu/weights_fit_check.py, 2026-12-06):
  the check is that much lenient, never stricter than vLLM, whose own budget starts from CUDA's figure.
Tensors vLLM skips (a DeepSeek-V3 checkpoint's multi-token-prediction layer) are counted: a few percent, erring
toward a refusal only where a start would have had that little room left for activations and the KV cache.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from eagle3_workflow.files.target_weights import NotSafetensors, safetensors_header, weight_files
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.serving")

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
STORED_BYTES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                "F8_E5M2": 1, "F8_E8M0": 1}  # fmt: skip
SERVED_FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4, "auto": 2}


@dataclasses.dataclass(frozen=True)
class WeightsFit:
    weight_bytes: int  # the whole target's, as served
    tensor_parallel_size: int
    gpu_bytes: int  # one GPU's memory
    budget_bytes: int  # what vLLM may take of it
    fits: bool

    @property
    def per_rank_bytes(self) -> int:
        return math.ceil(self.weight_bytes / self.tensor_parallel_size)

    def smallest_size(self) -> int | None:
        """The smallest power-of-two tensor-parallel size whose ranks' weights fit the budget; None when the budget is
        nothing (a KV cache as large as the GPU)."""
        if self.budget_bytes <= 0:
            return None
        size = 1
        while self.weight_bytes / size > self.budget_bytes:
            size *= 2
        return size


def served_weight_bytes(headers: Iterable[Mapping[str, Any]], dtype: str) -> int:
    """The weights' bytes as vLLM holds them: floating-point tensors at the serving dtype's width, others as stored."""
    float_bytes = SERVED_FLOAT_BYTES.get(dtype, 2)
    total = 0
    for header in headers:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            numel = math.prod(entry["shape"])
            if entry["dtype"] in FLOAT_DTYPES:
                total += numel * float_bytes
            elif entry["dtype"] in STORED_BYTES:
                total += numel * STORED_BYTES[entry["dtype"]]
            else:  # an unknown dtype: its stored bytes
                begin, end = entry["data_offsets"]
                total += end - begin
    return total


def weights_fit(weight_bytes: int, tensor_parallel_size: int, gpu_bytes: int, *, utilization: float,
                kv_cache_bytes: int | None) -> WeightsFit:  # fmt: skip
    budget = gpu_bytes - kv_cache_bytes if kv_cache_bytes else int(gpu_bytes * utilization)
    fits = weight_bytes / tensor_parallel_size <= budget
    return WeightsFit(weight_bytes, tensor_parallel_size, gpu_bytes, budget, fits)


def human(size: float) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def refusal(fit: WeightsFit, *, model: str, setting: str) -> str:
    size = fit.smallest_size()
    if size is None:
        return (
            f"vllm.kv_cache_memory_bytes leaves no room for the target's weights on its GPUs: the KV cache asks for "
            f"{human(fit.gpu_bytes - fit.budget_bytes)} of a {human(fit.gpu_bytes)} GPU.\n"
            "Fix: set vllm.kv_cache_memory_bytes (or evaluate.kv_cache_memory_bytes) well below the GPU's memory, or "
            "null to let vLLM size the cache from vllm.gpu_memory_utilization."
        )
    return (
        f"the target's weights do not fit its GPUs: {model} holds {human(fit.weight_bytes)} of weights as "
        f"served, {human(fit.per_rank_bytes)} per rank at {setting} = {fit.tensor_parallel_size}, and vLLM "
        f"may take at most {human(fit.budget_bytes)} of one {human(fit.gpu_bytes)} GPU "
        "(vllm.gpu_memory_utilization, or the GPU less vllm.kv_cache_memory_bytes), before activations and the KV "
        "cache.\n"
        f"Fix: set {setting} to {size} or more (a divisor of the attention heads, on as many GPUs: "
        "the stage's gpus setting), or serve the target on larger GPUs."
    )


def read_headers(model: Path) -> list[dict[str, Any]]:
    """The JSON header (8 bytes of length, then the header) of each safetensors file vLLM loads from a model folder:
    the files its weight map names (files.target_weights: the index, as vLLM filters them, or model.safetensors), else
    every one (a sharded folder without an index)."""
    try:
        paths = [model / name for name in sorted(set(weight_files(model).values()))]
    except NotSafetensors:
        paths = sorted(model.glob("*.safetensors"))
    return [safetensors_header(path) for path in paths]


def smallest_gpu_bytes() -> int | None:
    """The memory of the smallest GPU of the machine (nvidia-smi, MiB), or None where it cannot be read."""
    import subprocess  # here: the evaluation modules that reach this one stay free of it at import

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
        rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
        totals = {int(index): int(float(total)) * 2**20 for index, total in rows}
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("GPU memory not read (nvidia-smi): %r; the weights-fit check is skipped", exc)
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    chosen = [totals[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) in totals]
    return min(chosen or totals.values()) if totals else None


def check_weights_fit(model: str | Path, *, tensor_parallel_size: int, dtype: str, utilization: float,
                      kv_cache_bytes: int | None, setting: str, gpu_bytes: int | None = None) -> WeightsFit | None:  # fmt: skip
    """Refuse (StageError, with the fix) a target whose weights cannot fit its ranks' GPUs; None where the GPU or the
    checkpoint cannot be read (the check is skipped, and says so)."""
    headers = read_headers(Path(model))
    if not headers:
        log.info("weights-fit check skipped: no safetensors files in %s", model)
        return None
    gpu_bytes = smallest_gpu_bytes() if gpu_bytes is None else gpu_bytes
    if gpu_bytes is None:
        return None
    fit = weights_fit(served_weight_bytes(headers, dtype), tensor_parallel_size, gpu_bytes, utilization=utilization,
                      kv_cache_bytes=kv_cache_bytes)  # fmt: skip
    if not fit.fits:
        raise StageError(refusal(fit, model=str(model), setting=setting))
    log.info("weights fit: %s per rank at %s = %d, of %s vLLM may take on one GPU", human(fit.per_rank_bytes),
             setting, tensor_parallel_size, human(fit.budget_bytes))  # fmt: skip
    return fit
