"""`reference.device: cuda` against the CPU on the lent GPU machine (issue #41): the streamed fp32 reference of two
small targets built here, run on both devices, compared at every depth. Needs no pytest (the carried wheels have
none); tests/gpu/test_reference_device.py runs the same comparison under pytest where it is installed.

    source /tmp/site/ENV.sh && python3 bench/gpu/reference_device_check.py --out $OUT/reference_device.json

The targets: the INT4 Kimi-K2.5 stand-in (its wrapper layout, the int4 experts dequantized on the device, MLA,
sigmoid + noaux_tc routing over 384 experts top-8; 4 layers, hidden 256) and a tiny Llama (4 layers). The bound,
1e-4 of a sample's largest magnitude per token: both are fp32 forwards of the same weights that differ only in the
order of their sums (TF32 off: reference.full_depth.exact_fp32), each dot product off by about sqrt(K) x 2^-24 of
its size (K <= 512 here), ~1e-6 relative a layer. The gates resolve 0.05 (canary) and 0.1 (full depth), 500x
coarser. A token whose top-8 routing flips on a near-tie would differ by more: the json counts such tokens apart
(`tokens_over`), and any fails the check.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

BOUND = 1e-4
SAMPLES = [list(range(5, 69)), list(range(100, 117))]  # 64 and 17 tokens, one right-padded batch
CORPUS = [REPO / "config" / "data" / "tiny_conversations.jsonl", REPO / "config" / "data" / "seed_prompts.txt"]


def build_targets(root: Path) -> dict[str, Path]:
    from eagle3_workflow.settings.sections import KimiShape, TinyShape
    from eagle3_workflow.settings.views import view_of, with_schema_defaults
    from eagle3_workflow.target_build.kimi import build_kimi_k25_target
    from eagle3_workflow.target_build.tiny import build_tiny_target

    def shape(model, build):  # noqa: ANN001, ANN202
        return view_of(model, with_schema_defaults(target={"build": build})["target"]["build"])

    kimi = {"kind": "kimi_k25", "quantization": "int4", "num_layers": 4, "hidden_size": 256, "head_dim": 128,
            "weights": "trained_like", "vocab_size": 1024, "seed": 0}  # fmt: skip
    llama = {"kind": "tiny", "arch": "llama", "num_layers": 4}
    return {
        "kimi-int4": build_kimi_k25_target(root / "kimi", CORPUS, shape(KimiShape, kimi)),
        "llama": build_tiny_target(root / "llama", CORPUS, shape(TinyShape, llama)),
    }


def streamed(target: Path, device: str) -> tuple[dict, float]:
    from eagle3_workflow.reference.full_depth import stream_reference

    states: dict = {}

    def visit(label: str, s) -> None:  # noqa: ANN001
        if s.device.type != "cpu":
            raise AssertionError(f"visit got states on {s.device}: they must reach it on the CPU")
        states[label] = s.clone()

    started = time.monotonic()
    stream_reference(target, SAMPLES, visit, trust_remote_code=False, device=device)
    return states, time.monotonic() - started


def compare(target: Path) -> dict:
    on_cpu, cpu_s = streamed(target, "cpu")
    on_cuda, cuda_s = streamed(target, "cuda")
    if set(on_cpu) != set(on_cuda):
        return {"passed": False, "why": f"depths differ: {sorted(on_cpu)} vs {sorted(on_cuda)}"}
    worst, over = 0.0, 0
    per_depth = {}
    for label, expected in on_cpu.items():
        depth_worst = 0.0
        for b, ids in enumerate(SAMPLES):
            want, got = expected[b, : len(ids)], on_cuda[label][b, : len(ids)]
            rel = (got - want).abs().amax(dim=-1) / want.abs().max()
            depth_worst = max(depth_worst, float(rel.max()))
            over += int((rel >= BOUND).sum())
        per_depth[label] = depth_worst
        worst = max(worst, depth_worst)
    return {"passed": over == 0, "worst_rel": worst, "bound": BOUND, "tokens_over": over, "per_depth": per_depth,
            "cpu_s": round(cpu_s, 2), "cuda_s": round(cuda_s, 2)}  # fmt: skip


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("reference_device_check: no CUDA device here; it runs on the GPU machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: compare(path) for name, path in build_targets(Path(tmp)).items()}
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "targets": results,
              "passed": all(r["passed"] for r in results.values())}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
