"""A random-weight target in the exact shape of Llama-3.1-8B, built where it runs (nothing is downloaded).

usage: python bench/gpu/build_8b_shape_target.py OUT_DIR [--config bench/gpu/llama8b-shape-config.json]
                                                 [--device cuda] [--layers N --hidden H]   (N, H: CPU smoke tests)

Tokenizer: the tiny target's (eagle3_workflow.target_build.tiny.build_tokenizer: byte-level BPE trained on the
shipped text, ChatML-style chat template), ~1,020 tokens from that corpus. The model keeps Llama-3.1-8B's
vocab_size 128256 (embedding and lm_head of the real shape, so prefill, verifier logits in training and the
d2t/t2d mapping cost what they cost for the real model); ids >= len(tokenizer) are padding, as in real
checkpoints whose embedding is larger than the tokenizer: their lm_head rows are zero, so greedy decoding
never picks one (every real token's logit is far above 0 after the x8 scale below) and nothing has to
detokenize them. The real rows of lm_head are scaled x8, as the tiny target does, so the random model has
confident preferences that a draft can learn.

Weights are initialised on the GPU in bf16 (HF's own init), then saved as sharded safetensors (~16 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

CORPUS = [REPO / "config" / "data" / "tiny_conversations.jsonl", REPO / "config" / "data" / "seed_prompts.txt"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("llama8b-shape-config.json"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=None, help="override (smoke tests only)")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke tests only)")
    parser.add_argument("--vocab", type=int, default=None, help="override (smoke tests only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from eagle3_workflow.target_build.tiny import build_tokenizer

    started = time.monotonic()
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(CORPUS, 32000)  # the corpus saturates far below this: every merge it has
    shape = json.loads(args.config.read_text())
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.hidden:
        shape["hidden_size"] = args.hidden
        shape["intermediate_size"] = args.hidden * 3
        shape["num_attention_heads"] = args.hidden // 128 or 1
        shape["num_key_value_heads"] = max(1, shape["num_attention_heads"] // 4)
        shape["head_dim"] = min(128, args.hidden)
    if args.vocab:
        shape["vocab_size"] = args.vocab
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")}
    shape.update(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|pad|>"])
    shape.pop("torch_dtype", None)
    shape.pop("architectures", None)
    shape.pop("model_type", None)
    config = LlamaConfig(**shape)
    real = len(tokenizer)
    if config.vocab_size < real:
        raise SystemExit(f"vocab_size {config.vocab_size} < tokenizer's {real}")
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight[:real].mul_(8.0)
        model.lm_head.weight[real:].zero_()
    params = sum(p.numel() for p in model.parameters())
    built = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size="5GB")
    tokenizer.save_pretrained(args.out)
    model.generation_config.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in args.out.glob("*.safetensors"))
    print(
        json.dumps(
            {
                "target": str(args.out),
                "params": params,
                "layers": config.num_hidden_layers,
                "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size,
                "tokenizer_tokens": real,
                "bytes": size,
                "init_s": round(built, 1),
                "total_s": round(time.monotonic() - started, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
