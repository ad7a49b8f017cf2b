"""serving/fit.py's weights-fit check on the lent GPU machine: the real nvidia-smi and driver, not the CPU tests' fake.
Needs no carried wheel (fit.py imports the standard library only; torch is the image's), so it fits a call of its
own after a machine start:

    python3 bench/gpu/weights_fit_check.py --out $OUT/weights_fit.json

What it proves, each a check that fails the script (exit 1) with what it saw:
- `gpu_read`: the GPU memory the check plans with (nvidia-smi's memory.total of the smallest visible GPU) is not below
  what CUDA reports for that GPU (torch.cuda.mem_get_info's total), beyond nvidia-smi's rounding to whole MiB. Below
  it, the check could refuse a target that fits. Above it (memory CUDA does not hand out), the check is lenient by
  the gap, which the json records (`lenient_by_bytes`): it only lets through targets within that gap of the line,
  and vLLM's own start refuses those.
- `visible_devices`: CUDA_VISIBLE_DEVICES naming one GPU gives that GPU's memory.
- `refused`: a checkpoint whose weights are 1.5x the GPU (bf16 tensors in a sparse safetensors file: the exact format,
  no disk written) is refused at tensor_parallel_size 1, the message naming the setting and the size that fits, 2;
- `fits_at_2`: the same checkpoint passes at 2 (0.75 of the GPU per rank, under 0.85 x the GPU);
- `kv_cache_too_large`: a KV cache of the whole GPU leaves the weights nothing, and the refusal says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

MIB = 2**20
UTILIZATION = 0.85  # the GPU presets' vllm.gpu_memory_utilization
SETTING = "extraction.tensor_parallel_size"


def write_sparse_checkpoint(folder: Path, weight_bytes: int) -> Path:
    """A safetensors file (8 bytes of header length, the JSON header, the data) of bf16 matrices adding up to
    `weight_bytes`, its data a hole in a sparse file: the header is what the check reads."""
    rows = 8192
    columns = 8192
    matrix_bytes = rows * columns * 2
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for index in range(-(-weight_bytes // matrix_bytes)):
        header[f"model.layers.{index}.mlp.down_proj.weight"] = {
            "dtype": "BF16",
            "shape": [rows, columns],
            "data_offsets": [offset, offset + matrix_bytes],
        }
        offset += matrix_bytes
    raw = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return path


def cuda_totals() -> dict[int, int]:
    """Each visible GPU's total memory as CUDA reports it (bytes), keyed by CUDA's index."""
    import torch

    return {index: torch.cuda.mem_get_info(index)[1] for index in range(torch.cuda.device_count())}


def run_checks(work: Path) -> dict:
    from eagle3_workflow.serving.fit import check_weights_fit, smallest_gpu_bytes
    from eagle3_workflow.settings.errors import StageError

    checks: dict[str, dict] = {}
    cuda = cuda_totals()
    planned = smallest_gpu_bytes()
    smallest_cuda = min(cuda.values())
    checks["gpu_read"] = {
        "nvidia_smi_bytes": planned,
        "cuda_bytes": cuda,
        "lenient_by_bytes": None if planned is None else planned - smallest_cuda,
        "passed": planned is not None and planned >= smallest_cuda - MIB,
    }
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    try:
        one = smallest_gpu_bytes()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    checks["visible_devices"] = {"gpu_0_bytes": one, "passed": one is not None and abs(one - cuda[0]) <= max(
        MIB, (checks["gpu_read"]["lenient_by_bytes"] or 0))}  # fmt: skip

    gpu = planned or smallest_cuda
    model = work / "too-large"
    write_sparse_checkpoint(model, int(gpu * 1.5))
    kwargs = {"dtype": "bfloat16", "utilization": UTILIZATION, "setting": SETTING}

    def refusal(folder: Path, tensor_parallel_size: int, kv_cache_bytes: int | None) -> str | None:
        """The check's refusal message, or None where it let the target through."""
        try:
            check_weights_fit(
                folder, tensor_parallel_size=tensor_parallel_size, kv_cache_bytes=kv_cache_bytes, **kwargs
            )
        except StageError as exc:
            return str(exc)
        return None

    started = time.monotonic()
    message = refusal(model, 1, None)
    checks["refused"] = {
        "seconds": round(time.monotonic() - started, 3),
        "message": message,
        "passed": message is not None and f"Fix: set {SETTING} to 2 or more" in message,
    }
    fit = check_weights_fit(model, tensor_parallel_size=2, kv_cache_bytes=None, **kwargs)
    checks["fits_at_2"] = {"per_rank_bytes": fit and fit.per_rank_bytes, "budget_bytes": fit and fit.budget_bytes,
                           "passed": fit is not None and fit.fits}  # fmt: skip
    small = work / "small"
    write_sparse_checkpoint(small, 2**30)
    message = refusal(small, 1, gpu)
    checks["kv_cache_too_large"] = {"message": message,
                                    "passed": message is not None and "leaves no room" in message}  # fmt: skip
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("weights_fit_check: needs a CUDA device (the lent GPU machine)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        checks = run_checks(Path(tmp))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "checks": checks,
        "passed": all(check["passed"] for check in checks.values()),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
