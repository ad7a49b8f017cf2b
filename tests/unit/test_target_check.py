"""A model the user brings: the target sanity verdict, the assistant stop set derived from the chat template,
check_api's advice for an architecture this vLLM cannot capture, and group-readable artefacts. The rule through
Snakemake: tests/integration/test_target_check_rule.py."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import pytest
from conftest import api_report

from eagle3_workflow.files.chat import assistant_stop_set
from eagle3_workflow.target_check.sanity import SANITY_PROMPTS, answer_problem, failure_message, judge

# ---------------------------------------------------------------- the verdict (pure)


@pytest.mark.parametrize(
    "answer,problem",
    [
        ("", "empty"),
        ("  \n ", "empty"),
        ("...", "empty"),
        ("What is the capital of France? Answer in one sentence.", "echoes"),
        ("what is the capital of france answer in one sentence and then", "echoes"),
        ("the capital of France", "repeats part"),
        ("The capital of France is Paris.", None),
        ("Paris", None),
    ],
)
def test_answer_problem(answer, problem):
    found = answer_problem(SANITY_PROMPTS[0], answer)
    assert (found is None) if problem is None else (problem in found)


def test_one_bad_answer_fails_the_report_with_a_clear_message():
    answers = [(p, "A fine answer, certainly.", "stop") for p in SANITY_PROMPTS]
    assert judge("/m", 32, [2], answers).passed
    answers[1] = (SANITY_PROMPTS[1], "", "stop")
    report = judge("/m", 32, [2], answers)
    assert not report.passed
    message = failure_message(report)
    assert "1 of 3" in message
    assert "base (not instruct)" in message
    assert "target_check.enabled: false" in message


# ---------------------------------------------------------------- the stop set from the template's end-of-turn

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PLAIN_TEXT = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n### End\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)
TURN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TURN_TOKENS += ["<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def turn_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    return tokenizer


@pytest.mark.parametrize(
    "template,end_of_turn",
    [(CHATML, "<|im_end|>"), (LLAMA3, "<|eot_id|>"), (GEMMA, "<end_of_turn>")],
    ids=["chatml", "llama3", "gemma"],
)
def test_stop_set_holds_the_templates_end_of_turn_and_eos(turn_tokenizer, template, end_of_turn):
    tokenizer = copy.deepcopy(turn_tokenizer)
    tokenizer.chat_template = template
    stop = assistant_stop_set(tokenizer)
    assert tokenizer.convert_tokens_to_ids(end_of_turn) in stop.token_ids
    assert tokenizer.eos_token_id in stop.token_ids
    assert stop.strings == []
    assert stop.end_of_turn.startswith(end_of_turn)


def test_a_plain_text_end_of_turn_is_a_stop_string(turn_tokenizer):
    tokenizer = copy.deepcopy(turn_tokenizer)
    tokenizer.chat_template = PLAIN_TEXT
    stop = assistant_stop_set(tokenizer)
    assert stop.strings == ["### End"]
    assert stop.token_ids == [tokenizer.eos_token_id]


# ---------------------------------------------------------------- check_api: an architecture vLLM cannot capture


def test_check_api_lists_the_architectures_this_vllm_can_capture(tiny_targets, tmp_path):
    from eagle3_workflow.api_checks.checks import failure_advice
    from eagle3_workflow.api_checks.vllm_surfaces import eagle3_capable_architectures

    target = tmp_path / "model"
    target.mkdir()
    config = json.loads((tiny_targets("llama") / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]  # registered in vLLM, without SupportsEagle3
    (target / "config.json").write_text(json.dumps(config))
    for source in tiny_targets("llama").iterdir():  # the tokenizer and its chat template
        if source.is_file() and source.name != "config.json" and not source.name.endswith(".safetensors"):
            (target / source.name).write_bytes(source.read_bytes())
    # no weights copied: the rows that build a reference from them (full depth, the canary's) are not under test
    report = api_report(target, full_depth_check=False, canary_reference="self_consistency")
    failed = [r for r in report.checks if not r.passed]
    assert [r.name for r in failed] == ["target architecture"]
    assert "supports_eagle3=False" in failed[0].found
    capable = eagle3_capable_architectures()  # read from the installed vLLM's registry
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"} <= set(capable)
    assert "GPT2LMHeadModel" not in capable
    assert not any("Eagle" in a for a in capable)
    advice = failure_advice(failed, capable)
    assert "this vLLM cannot capture" in advice
    assert "Environment" not in advice
    assert "LlamaForCausalLM" in advice
    assert f"these {len(capable)}" in advice


# ---------------------------------------------------------------- group-readable artefacts


def group_readable(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IRGRP)


def test_a_built_tiny_target_is_group_readable(tiny_targets):
    target = tiny_targets("llama")
    files = [p for p in target.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files)
    assert [p.name for p in files if not group_readable(p)] == []


def test_an_atomic_json_write_follows_the_umask(tmp_path):
    import os

    from eagle3_workflow.files.artefacts import CheckRow, write

    previous = os.umask(0o027)  # group may read, others may not
    try:
        write(tmp_path / "a.json", CheckRow(name="x", expected="1", found="1", passed=True))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640


def test_safetensors_files_are_shared_as_the_umask_allows(tmp_path):
    import torch
    from safetensors.torch import save_file

    from eagle3_workflow.files.writing import share_as_umask_allows

    (tmp_path / "files").mkdir()
    save_file({"hidden_states": torch.zeros(2, 2)}, str(tmp_path / "files" / "hs_0.safetensors"))
    assert not group_readable(tmp_path / "files" / "hs_0.safetensors")  # why the helper exists (safetensors 0.8)
    share_as_umask_allows(tmp_path / "files")
    assert group_readable(tmp_path / "files" / "hs_0.safetensors")


# ---------------------------------------------------------------- regenerate and evaluate stop at the end-of-turn


def test_regenerated_answers_stop_at_the_templates_end_of_turn(turn_tokenizer, tmp_path):
    from eagle3_workflow.regenerate.generate import regenerate
    from eagle3_workflow.regenerate.prompts import Completion
    from eagle3_workflow.settings.sections import RegenerateSettings
    from eagle3_workflow.settings.views import with_schema_defaults

    tokenizer = copy.deepcopy(turn_tokenizer)
    tokenizer.chat_template = GEMMA  # ends a turn with <end_of_turn>, which is not the eos
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn != tokenizer.eos_token_id
    requests = []

    def generate(prompt_ids, sampling):
        requests.extend(sampling)
        return [Completion("Blue.", 2, "stop") for _ in prompt_ids]

    prompts = tmp_path / "p.txt"
    prompts.write_text("Name a colour.\n")
    settings = RegenerateSettings.model_validate(with_schema_defaults(regenerate={"max_tokens": 8})["regenerate"])
    _, stats = regenerate(tokenizer, generate, [prompts], settings, max_model_len=512)
    assert requests
    assert all(end_of_turn in s.stop_token_ids for s in requests)
    assert end_of_turn in stats.stop_token_ids
    assert tokenizer.eos_token_id in stats.stop_token_ids


def test_evaluation_sampling_carries_the_stop_set_to_the_measurement_process(tmp_path):
    from eagle3_workflow.evaluation.measure import measured_sampling
    from eagle3_workflow.evaluation.protocol import MeasurementSpec
    from eagle3_workflow.files.artefacts import load, write

    spec = MeasurementSpec(engine={}, prompts=[[1]], max_tokens=4, timing_repeats=1, runs=[], stop_token_ids=[2, 7])
    write(tmp_path / "spec.json", spec)
    again = load(MeasurementSpec, tmp_path / "spec.json")  # as the child reads it
    assert measured_sampling(again)["stop_token_ids"] == [2, 7]
