"""prepare_data: loss masks on several chat templates, every bad-record path, and the zero-kept failure."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import pytest
from conftest import preparation

from eagle3_workflow.files.chat import tokenize_conversation
from eagle3_workflow.prepare.conversations import prepare_conversations, token_frequencies
from eagle3_workflow.prepare.repetition import repeated_share
from eagle3_workflow.settings.errors import StageError

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WITH_GENERATION = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 style: system folded into a header, no generation markers, assistant header added by the prompt
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>\n\n{{ m['content'] | trim }}"
    "<|end_of_text|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_end|>\n\n{% endif %}"
)

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
    {"role": "user", "content": "And 3 times 3?"},
    {"role": "assistant", "content": "3 times 3 is 9."},
]


@pytest.fixture
def tmp_path():
    """A short directory instead of pytest's: the bad-record table wraps a cell over 80 characters, and pytest's
    tmp_path (longer under xdist, .../popen-gw1/<test name>/) split the file:line these tests look for."""
    with tempfile.TemporaryDirectory(prefix="prepare-") as directory:
        yield Path(directory)


def with_template(tokenizer, template):
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def decoded_assistant_text(tokenizer, conv) -> str:
    return tokenizer.decode([t for t, m in zip(conv.input_ids, conv.loss_mask, strict=True) if m])


@pytest.mark.parametrize("template", [CHATML, WITH_GENERATION, LLAMA3_STYLE], ids=["chatml", "generation", "llama3"])
def test_mask_covers_exactly_the_assistant_turns(tiny_tokenizer, template):
    tokenizer = with_template(tiny_tokenizer, template)
    conv = tokenize_conversation(tokenizer, MULTI_TURN)
    text = decoded_assistant_text(tokenizer, conv)
    assert "2 plus 2 is 4." in text
    assert "3 times 3 is 9." in text
    for leaked in ("You are terse", "What is 2 plus 2", "And 3 times 3", "system", "user"):
        assert leaked not in text, f"{leaked!r} is trained on"
    assert conv.input_ids == tokenizer(conv.text, add_special_tokens=False)["input_ids"]


def test_mask_matches_transformers_generation_mask(tiny_tokenizer):
    """Where the template has {% generation %}, the render-diff mask equals transformers' own mask, except
    that render-diff also trains the newline the template emits after the end-of-turn marker."""
    tokenizer = with_template(tiny_tokenizer, WITH_GENERATION)
    ours = tokenize_conversation(tokenizer, MULTI_TURN)
    theirs = tokenizer.apply_chat_template(
        MULTI_TURN, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(theirs["input_ids"]) == ours.input_ids
    reference = list(theirs["assistant_masks"])
    extra = [i for i, (a, b) in enumerate(zip(ours.loss_mask, reference, strict=True)) if a != b]
    assert all(reference[i] == 0 for i in extra)
    assert all(tokenizer.decode([ours.input_ids[i]]).strip() == "" for i in extra)
    assert sum(reference) > 0
    assert sum(ours.loss_mask) >= sum(reference)


def test_end_of_turn_token_is_trained(tiny_tokenizer):
    conv = tokenize_conversation(tiny_tokenizer, MULTI_TURN)
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    trained_ends = [m for t, m in zip(conv.input_ids, conv.loss_mask, strict=True) if t == end]
    assert trained_ends.count(1) == 2  # the two assistant turns' ends, not the system/user ones


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


GOOD = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}
GOOD_MESSAGES = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]}


def test_sharegpt_messages_and_parquet_are_read(tiny_tokenizer, tmp_path):
    import pandas as pd

    a = write_jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    b = write_jsonl(tmp_path / "b.jsonl", [GOOD_MESSAGES])
    c = tmp_path / "c.json"
    c.write_text(json.dumps([GOOD]))
    d = tmp_path / "d.parquet"
    pd.DataFrame([GOOD_MESSAGES, GOOD_MESSAGES]).to_parquet(d)
    result = prepare_conversations(
        [(a, "sharegpt"), (b, "messages"), (c, "auto"), (d, "parquet")], tiny_tokenizer, preparation(max_seq_len=128)
    )
    assert len(result.samples) == 6
    assert result.manifest_counts["records_read"] == 6
    assert sum(token_frequencies(result.samples).values()) == sum(sum(s.loss_mask) for s in result.samples)


BAD_CASES = {
    "malformed_json": '{"conversations": [',
    "invalid_record": {"text": "no conversation here"},
    "no_assistant_turn": {"conversations": [{"from": "human", "value": "only a question"}]},
    "unknown_role": {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
    "non_string_content": {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_record_fails_with_file_and_line(tiny_tokenizer, tmp_path, case):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, BAD_CASES[case], GOOD])
    with pytest.raises(StageError) as info:
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128))
    message = str(info.value)
    assert f"{path}:2" in message
    assert "on_bad_record: skip" in message


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_record_skipped_and_counted(tiny_tokenizer, tmp_path, case):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, BAD_CASES[case], GOOD])
    result = prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128, on_bad_record="skip"))
    assert len(result.samples) == 2
    assert sum(result.manifest_counts["dropped"].values()) == 1


def test_truncation_that_removes_every_assistant_token_is_a_bad_record(tiny_tokenizer, tmp_path):
    long_user = {"conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}]}
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, long_user])
    with pytest.raises(StageError, match="no_assistant_tokens"):
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=32))
    result = prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=32, on_bad_record="skip"))
    assert result.manifest_counts["dropped"] == {"no_assistant_tokens": 1}


def test_overlength_drop_and_truncate(tiny_tokenizer, tmp_path):
    long_answer = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "word " * 200}]}
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, long_answer])
    dropped = prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=64, overlength="drop"))
    assert len(dropped.samples) == 1
    assert dropped.manifest_counts["dropped"] == {"overlength": 1}
    truncated = prepare_conversations(
        [(path, "auto")], tiny_tokenizer, preparation(max_seq_len=64, overlength="truncate")
    )
    assert len(truncated.samples) == 2
    assert truncated.manifest_counts["truncated"] == 1
    assert max(len(s.input_ids) for s in truncated.samples) == 64


def test_repeated_share_is_zero_without_repeats_and_near_one_for_a_greedy_loop():
    assert repeated_share("def add(a, b): return a + b  # adds two numbers and returns the sum") == 0.0
    assert repeated_share("return the list of items " * 40) > 0.9
    assert repeated_share("too short") == 0.0
    # one line said twice in twelve words: 1 of the 5 eight-word windows has been seen
    assert repeated_share("a b c d e f g h a b c d") == 0.0
    assert repeated_share("a b c d e f g h a b c d e f g h") == pytest.approx(1 / 9)


def test_a_looping_answer_is_dropped_as_repetitive_only_when_asked(tiny_tokenizer, tmp_path):
    loop = {"conversations": [{"from": "human", "value": "sum a list"}, {"from": "gpt", "value": "x = x + 1 " * 30}]}
    # the loop in the second answer of two: every assistant turn is judged
    late_loop = {"messages": MULTI_TURN[:3] + [MULTI_TURN[3], {"role": "assistant", "content": "9. " + "so 9 " * 40}]}
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, loop, late_loop])
    kept_all = prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=512))
    assert len(kept_all.samples) == 3 and kept_all.manifest_counts["dropped"] == {}
    filtered = prepare_conversations(
        [(path, "auto")], tiny_tokenizer, preparation(max_seq_len=512, max_repeated_share=0.5)
    )
    assert [s.line for s in filtered.samples] == [1]
    assert filtered.manifest_counts["dropped"] == {"repetitive": 2}
    assert filtered.manifest_counts["records_read"] == 3


def test_zero_kept_fails_with_the_reason(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [BAD_CASES["no_assistant_turn"]] * 3)
    with pytest.raises(StageError, match="no record survived") as info:
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128, on_bad_record="skip"))
    assert "no_assistant_turn" in str(info.value)


def test_missing_source_is_named(tiny_tokenizer, tmp_path):
    with pytest.raises(StageError, match="does not exist"):
        prepare_conversations([(tmp_path / "nope.jsonl", "auto")], tiny_tokenizer, preparation(max_seq_len=128))


def assert_one_bad_record(tokenizer, path: Path, *, line: int, reason: str, kept: int) -> None:
    """on_bad_record fail: the error names the record's file:line and reason; skip: the other records are kept and
    the reason counted once."""
    with pytest.raises(StageError) as info:
        prepare_conversations([(path, "auto")], tokenizer, preparation(max_seq_len=128))
    assert f"{path}:{line}" in str(info.value)
    assert reason in str(info.value)
    result = prepare_conversations([(path, "auto")], tokenizer, preparation(max_seq_len=128, on_bad_record="skip"))
    assert len(result.samples) == kept
    assert result.manifest_counts["dropped"] == {reason: 1}


EMPTY_TURN = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}


def test_empty_turn_is_a_bad_record_with_file_and_line(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, EMPTY_TURN])
    assert_one_bad_record(tiny_tokenizer, path, line=2, reason="empty_turn", kept=1)


def test_non_utf8_line_is_a_bad_record_and_skip_skips_it(tiny_tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    bad_line = json.dumps(GOOD).replace("hello", "h\xe9llo").encode("latin-1")  # é as one latin-1 byte
    path.write_bytes(b"\n".join([json.dumps(GOOD).encode(), bad_line, json.dumps(GOOD).encode()]) + b"\n")
    assert_one_bad_record(tiny_tokenizer, path, line=2, reason="not_utf8", kept=2)


def test_non_utf8_json_array_names_file_and_line(tiny_tokenizer, tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'[\n{"conversations": []},\n{"x": "\xff"}\n]\n')
    with pytest.raises(StageError) as info:
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128))
    assert f"{path}:3" in str(info.value)
    assert "not_utf8" in str(info.value)


def test_each_record_counted_under_one_outcome(tiny_tokenizer, tmp_path):
    long_user = {"conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}]}
    long_answer = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "word " * 200}]}
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, long_user, long_answer])
    result = prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=32, on_bad_record="skip"))
    counts = result.manifest_counts
    # long_user was truncated, then dropped for no assistant tokens: dropped only, not also truncated
    assert counts["dropped"] == {"no_assistant_tokens": 1}
    assert counts["truncated"] == 1
    assert counts["records_read"] == len(result.samples) + sum(counts["dropped"].values())
    capped = prepare_conversations(
        [(path, "auto")], tiny_tokenizer, preparation(max_seq_len=32, on_bad_record="skip", max_samples=1, seed=1)
    )
    assert capped.manifest_counts["truncated"] == sum(s.truncated for s in capped.samples)


def test_empty_data_file_is_named(tiny_tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(StageError, match="empty") as info:
        prepare_conversations([(good, "auto"), (empty, "auto")], tiny_tokenizer, preparation(max_seq_len=128))
    assert str(empty) in str(info.value)


def test_declared_format_mismatch_names_the_format_that_fits(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD])
    with pytest.raises(StageError) as info:
        prepare_conversations([(path, "messages")], tiny_tokenizer, preparation(max_seq_len=128))
    message = str(info.value)
    assert "format_mismatch" in message
    assert "does not match" in message
    assert "format: sharegpt" in message
    assert "neither" not in message


def test_skip_with_nothing_kept_lists_every_bad_record(tiny_tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [BAD_CASES["invalid_record"], EMPTY_TURN])
    with pytest.raises(StageError, match="no record survived") as info:
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128, on_bad_record="skip"))
    assert f"{path}:1" in str(info.value)
    assert f"{path}:2" in str(info.value)


def test_bad_record_table_wraps_long_details_instead_of_cutting(tiny_tokenizer, tmp_path):
    record = {f"key_{i:02d}_{'x' * 8}": i for i in range(12)} | {"last_key_visible": 1}
    path = write_jsonl(tmp_path / "data.jsonl", [record])
    with pytest.raises(StageError) as info:
        prepare_conversations([(path, "auto")], tiny_tokenizer, preparation(max_seq_len=128))
    message = str(info.value)
    assert "last_key_visible" in message
    table = [line for line in message.splitlines() if " | " in line]
    assert len(table) > 2
    assert max(len(line) for line in table) <= len(f"{path}:1") + len(" | invalid_record | ") + 80
