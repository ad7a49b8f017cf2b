"""CPU study for issue #41: how often the Kimi-K2.5 stand-in's routing meets a near-tie, at the real hidden width.

Builds (target_build/kimi.py, the workflow's own builder) an N-layer slice of bench/gpu/kimi-k25-real-width.yaml at
hidden 7168 with narrow bf16 experts (their width does not enter the router), or that slice with the toy stand-in's
router (8 experts, top-2), then runs the gates' own fp32 reference over it (reference.full_depth.stream_reference,
one layer in memory at a time) with their own router probe (reference.layer_match.RoutingProbe). Prints JSON: per MoE layer
the fraction of tokens whose k-th and (k+1)-th selection scores are closer than bf16 serving can move them (the
canary's and full-depth check's "ambiguous"), the fraction ambiguous at some MoE layer up to each layer (what an id
at that depth may excuse), and the outlier channels' size over the median channel.

    PYTHONPATH=workflow/scripts .venv/bin/python bench/gpu/kimi_router_study.py OUT_DIR [--layers 8]
        [--experts 384 --top-k 8] [--moe-width 32] [--weights trained_like] [--tokens 4x128] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import torch
import yaml

from eagle3_workflow.reference.full_depth import stream_reference
from eagle3_workflow.reference.layer_match import RoutingProbe
from eagle3_workflow.settings.sections import KimiShape
from eagle3_workflow.settings.views import view_of, with_schema_defaults
from eagle3_workflow.target_build.kimi import OUTLIER_CHANNELS, build_kimi_k25_target

REPO = Path(__file__).resolve().parents[2]
CORPUS = [REPO / "config" / "data" / "tiny_conversations.jsonl", REPO / "config" / "data" / "seed_prompts.txt"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-width", type=int, default=32)
    parser.add_argument("--weights", default="trained_like", choices=["random", "trained_like"])
    parser.add_argument("--tokens", default="4x128", help="samples x tokens, random ids of the tokenizer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the built slice")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    build = yaml.safe_load((REPO / "bench" / "gpu" / "kimi-k25-real-width.yaml").read_text())["target"]["build"]
    # bf16 experts (the reference reads them directly); the tokenizer's own vocabulary: neither enters the router
    build |= {"num_layers": args.layers, "routed_experts": args.experts, "experts_per_token": args.top_k,
              "moe_intermediate_size": args.moe_width, "quantization": "none", "padded_vocab_size": None,
              "weights": args.weights}  # fmt: skip
    shape = view_of(KimiShape, with_schema_defaults(target={"build": build})["target"]["build"])
    target = args.out / "target"
    started = time.monotonic()
    build_kimi_k25_target(target, CORPUS, shape)
    built_s = time.monotonic() - started

    samples, tokens = (int(x) for x in args.tokens.split("x"))
    generator = torch.Generator().manual_seed(0)
    batch = [torch.randint(10, 1000, (tokens,), generator=generator).tolist() for _ in range(samples)]
    outliers: dict[int, float] = {}
    started = time.monotonic()
    with RoutingProbe() as probe:

        def visit(label: str, states: torch.Tensor) -> None:
            probe.visited(label, states)
            if label.isdigit():
                size = states.abs().float().reshape(-1, states.shape[-1])
                ratio = size.median(dim=0).values / size.median()
                outliers[int(label)] = round(float(ratio.topk(OUTLIER_CHANNELS).values.min()), 1)

        stream_reference(target, batch, visit, trust_remote_code=False, device="cpu")
    reference_s = time.monotonic() - started
    per_layer = {k: round(float(v.float().mean()), 4) for k, v in sorted(probe.ambiguous.items())}
    upstream, seen = {}, torch.zeros_like(next(iter(probe.ambiguous.values())))
    for layer in sorted(probe.ambiguous):
        seen = seen | probe.ambiguous[layer]
        upstream[layer + 1] = round(float(seen.float().mean()), 4)  # an id past this layer may excuse these tokens
    result = {
        "hidden": shape.hidden_size, "layers": args.layers, "experts": args.experts, "top_k": args.top_k,
        "moe_width": args.moe_width, "weights": args.weights, "tokens": samples * tokens,
        "near_tie_fraction_per_moe_layer": per_layer, "ambiguous_upstream_fraction_at_id": upstream,
        "outlier_channels_min_over_median_at_layer_input": outliers,
        "build_s": round(built_s, 1), "reference_s": round(reference_s, 1),
        "max_rss_GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }  # fmt: skip
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(target)


if __name__ == "__main__":
    main()
