"""Stage `build_tiny_target`: a tiny random-weight target with a locally trained tokenizer.

Self-contained (no model hub): a byte-level BPE tokenizer trained on the given text files, a ChatML-style chat
template without ``{% generation %}`` markers (the harder case for loss masks), and a random-weight model of the
chosen architecture saved as bf16 safetensors. Deterministic for a given seed and corpus.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.files.writing import share_as_umask_allows
from eagle3_workflow.settings.sections import TinyShape

log = logging.getLogger("eagle3.tiny_target")

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(corpus_files: list[Path], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [Path(f).read_text(encoding="utf-8", errors="ignore") for f in corpus_files]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def model_config(
    arch: str, *, num_layers: int, hidden_size: int, head_dim: int, vocab_size: int, bos: int, eos: int, pad: int
) -> Any:
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    heads = max(1, hidden_size // head_dim)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim, **common
        )
    if arch == "qwen3":
        return Qwen3Config(
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=head_dim, **common
        )
    if arch == "deepseek_v3":
        # vLLM's CPU MLA needs kv_lora_rank=512 and qk_rope_head_dim=64 (shared FEASIBILITY.md)
        cfg = DeepseekV3Config(
            num_attention_heads=heads,
            num_key_value_heads=heads,
            moe_intermediate_size=hidden_size // 2,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=512,
            q_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=64,
            v_head_dim=32,
            **common,
        )
        # keys a real DeepSeek-V3 config.json has; without topk_method vLLM skips e_score_correction_bias
        cfg.topk_method = "noaux_tc"
        cfg.scoring_func = "sigmoid"
        return cfg
    raise ValueError(f"unknown tiny target architecture {arch!r}; choose llama, qwen3 or deepseek_v3")


def build_tiny_target(out_dir: Path, corpus_files: list[Path], shape: TinyShape) -> Path:
    """A random-weight target of `shape` (target.build) with a tokenizer trained on `corpus_files`."""
    import torch
    from transformers import AutoModelForCausalLM

    arch, num_layers, hidden_size = shape.arch, shape.num_layers, shape.hidden_size
    torch.manual_seed(shape.seed)
    tokenizer = build_tokenizer(corpus_files, shape.vocab_size)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|begin_of_text|>", "<|im_end|>", "<|pad|>")}
    cfg = model_config(
        arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        head_dim=shape.head_dim,
        vocab_size=len(tokenizer),
        bos=ids["<|begin_of_text|>"],
        eos=ids["<|im_end|>"],
        pad=ids["<|pad|>"],
    )
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    # random init gives near-uniform logits; a larger output scale gives the target confident, learnable
    # preferences (as a trained model has), so acceptance of a trained draft is measurably above chance
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    share_as_umask_allows(out_dir)  # save_pretrained leaves model.safetensors 0600
    log.info(
        "built tiny %s target: %d layers, hidden %d, vocab %d, %d params -> %s",
        arch,
        num_layers,
        hidden_size,
        len(tokenizer),
        sum(p.numel() for p in model.parameters()),
        out_dir,
    )
    return out_dir
