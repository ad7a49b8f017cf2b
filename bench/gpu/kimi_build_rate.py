"""CPU measurements for the real-width Kimi-K2.5 stand-in's recipe (issue #41, docs/gpu.md), one thread:

build OUT [--layers 0,1]   draw, reshape (trained_like), pack (INT4) and write those decoder layers of
                           bench/gpu/kimi-k25-real-width.yaml exactly as build_kimi_k25_target does
                           (kimi.write_weights on the layers' names): seconds, bytes, peak RSS
dequantize OUT [--experts 192]
                           the full-depth reference's dequantization (reference.compressed_weights.dequantize) of that many
                           routed experts of layer 1 of a `build` folder: seconds (half a layer keeps memory low)

PYTHONPATH=workflow/scripts .venv/bin/python bench/gpu/kimi_build_rate.py build /tmp/rate
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time
from pathlib import Path

import torch
import yaml

from eagle3_workflow.reference import compressed_weights
from eagle3_workflow.settings.sections import KimiShape
from eagle3_workflow.settings.views import view_of, with_schema_defaults
from eagle3_workflow.target_build import kimi, kimi_layout

REPO = Path(__file__).resolve().parents[2]


def real_width_text() -> dict:
    build = yaml.safe_load((REPO / "bench" / "gpu" / "kimi-k25-real-width.yaml").read_text())["target"]["build"]
    shape = view_of(KimiShape, with_schema_defaults(target={"build": build})["target"]["build"])
    return kimi_layout.text_config(shape, vocab_size=163840, bos=0, eos=1, pad=2, quantized=True)


def peak_rss_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def build(out: Path, layers: list[int]) -> dict:
    shapes = kimi_layout.text_shapes(real_width_text())
    keep = {n: s for n, s in shapes.items() if any(n.startswith(f"language_model.model.layers.{i}.") for i in layers)}
    keep["language_model.model.norm.weight"] = shapes["language_model.model.norm.weight"]
    out.mkdir(parents=True, exist_ok=True)
    stored = sum(kimi.stored_bytes(n, s, quantized=True) for n, s in keep.items())
    started = time.monotonic()
    count = kimi.write_weights(out, keep, seed=0, quantized=True, weights="trained_like", device="cpu")
    seconds = time.monotonic() - started
    return {"layers": layers, "tensors": count, "parameters": sum(math.prod(s) for s in keep.values()),
            "stored_GB": round(stored / 1e9, 3), "seconds": round(seconds, 1), "peak_rss_GiB": peak_rss_gib()}  # fmt: skip


def dequantize(out: Path, experts: int) -> dict:
    from safetensors import safe_open

    checkpoint = compressed_weights.read_scheme(kimi_layout.model_config(real_width_text(), media_pad=3))
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if ".layers.1.mlp.experts." in n and int(n.split(".experts.")[1].split(".")[0]) < experts]
    tensors = {}
    for file in sorted({index[n] for n in names}):
        with safe_open(str(out / file), framework="pt") as handle:
            tensors |= {n: handle.get_tensor(n) for n in names if index[n] == file}
    started = time.monotonic()
    modules = compressed_weights.dequantize(tensors, checkpoint)
    seconds = time.monotonic() - started
    return {"experts": experts, "modules": len(modules), "seconds": round(seconds, 1),
            "seconds_per_layer_of_384": round(seconds * 384 / experts, 1), "peak_rss_GiB": peak_rss_gib()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["build", "dequantize"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", default="0,1")
    parser.add_argument("--experts", type=int, default=192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.step == "build":
        result = build(args.out, [int(x) for x in args.layers.split(",")])
    else:
        result = dequantize(args.out, args.experts)
    print(json.dumps({"step": args.step, "threads": 1, **result}))


if __name__ == "__main__":
    main()
