"""Prompts to answer: prompt files, conversations and their answer slots, and the turn-by-turn answering.

Pure: the target is reached only through the `GenerateFn` it is given (vLLM's in generate.py, a fake in tests).
Prompt files are ``.txt`` (one prompt per line) or ``.jsonl``/``.json`` records with ShareGPT ``conversations`` or
OpenAI ``messages`` (either JSON kind may be gzipped: ``.jsonl.gz``, ``.json.gz``), normalised by
files.chat.normalize_messages (the same roles as prepare_data reads).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import logging
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from eagle3_workflow.files.chat import StopSet, normalize_messages, render
from eagle3_workflow.settings.errors import StageError, render_table

log = logging.getLogger("eagle3.regenerate")

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}
MAX_REPORTED_BAD = 20


@dataclasses.dataclass
class PromptConversation:
    """Turns to answer: the assistant turns' contents are replaced (an empty slot ends a trailing user turn)."""

    messages: list[dict[str, str]]
    origin: str  # file:line, or magpie:<index>

    def dedup_key(self) -> tuple[tuple[str, str], ...]:
        """Non-assistant turns, whitespace-collapsed and case-folded: what makes two prompts the same."""
        return tuple(
            (m["role"], " ".join(m["content"].split()).casefold()) for m in self.messages if m["role"] != "assistant"
        )


def _conversation_from_turns(turns: Any, role_key: str, content_key: str) -> list[dict[str, str]]:
    """The record's turns with canonical roles; the assistant contents are emptied: they are the slots to answer."""
    messages = normalize_messages(turns, role_key=role_key, content_key=content_key, require_assistant=False)
    return [{**m, "content": "" if m["role"] == "assistant" else m["content"]} for m in messages]


def answer_slots(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Normalise to [system*] (user assistant)+: every user turn gets exactly one assistant slot after it.

    Assistant turns before the first user turn have nothing to answer and are dropped; a conversation that
    ends on a user turn gets a slot for the answer.
    """
    out: list[dict[str, str]] = []
    seen_user = False
    for message in messages:
        if message["role"] == "assistant":
            if seen_user and out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            continue
        if message["role"] == "user" and out and out[-1]["role"] == "user":
            out.append({"role": "assistant", "content": ""})
        seen_user = seen_user or message["role"] == "user"
        out.append(dict(message))
    if not seen_user:
        raise ValueError("conversation has no user turn to answer")
    if out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out


def read_prompt_file(path: Path) -> list[PromptConversation]:
    """A prompt file: .txt (one user prompt per non-blank line) or .jsonl/.json conversation records."""
    if not path.exists():
        raise StageError(f"prompt file {path} does not exist; fix regenerate.prompt_files in the config")
    if path.suffix == ".txt":
        return [
            PromptConversation(answer_slots([{"role": "user", "content": line.strip()}]), f"{path.name}:{lineno}")
            for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
            if line.strip()
        ]
    if json_kind(path) is None:
        raise StageError(
            f"prompt file {path} has suffix {''.join(path.suffixes)!r}; use .txt (one prompt per line) or "
            ".jsonl/.json (or .jsonl.gz/.json.gz) "
            "(records with 'conversations' or 'messages')"
        )
    prompts, bad = [], []
    for lineno, record in _json_records(path):
        try:
            prompts.append(PromptConversation(answer_slots(_record_turns(record)), f"{path.name}:{lineno}"))
        except ValueError as exc:
            bad.append((f"{path.name}:{lineno}", str(exc)))
    if bad:
        raise _bad_prompts(path, bad)
    return prompts


def json_kind(path: Path) -> str | None:
    """The kind of a JSON prompt file, ".jsonl" or ".json", gzipped or not; None for any other name."""
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    kind = suffixes[0] if suffixes else ""
    return kind if kind in (".jsonl", ".json") else None


def _json_records(path: Path) -> list[tuple[int, Any]]:
    """(line or position, record) of a JSON array file or a JSON-lines file; every unparsable line is named."""
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise StageError(f"prompt file {path} cannot be read: {exc!r}; write it again (gzip for a .gz name)") from exc
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as exc:
            raise StageError(f"prompt file {path} is not valid JSON: {exc!r}") from exc
    items, bad_json = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                items.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                bad_json.append((f"{path.name}:{lineno}", repr(exc)))
    if bad_json:
        raise _bad_prompts(path, bad_json)
    return items


def _record_turns(record: Any) -> list[dict[str, str]]:
    if isinstance(record, dict) and "conversations" in record:
        return _conversation_from_turns(record["conversations"], "from", "value")
    if isinstance(record, dict) and "messages" in record:
        return _conversation_from_turns(record["messages"], "role", "content")
    raise ValueError("record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")


def _bad_prompts(path: Path, bad: list[tuple[str, str]]) -> StageError:
    table = render_table(["where", "problem"], bad[:MAX_REPORTED_BAD])
    more = f"\n... and {len(bad) - MAX_REPORTED_BAD} more" if len(bad) > MAX_REPORTED_BAD else ""
    return StageError(
        f"{len(bad)} unusable record(s) in prompt file {path}:\n{table}{more}\n"
        "Fix or remove them; prompt files are authored input, so none is skipped silently."
    )


def deduplicate(prompts: Iterable[PromptConversation]) -> tuple[list[PromptConversation], int]:
    """First occurrence wins; returns (unique prompts in order, duplicates dropped)."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    unique: list[PromptConversation] = []
    duplicates = 0
    for prompt in prompts:
        key = prompt.dedup_key()
        if key in seen:
            duplicates += 1
        else:
            seen.add(key)
            unique.append(prompt)
    return unique, duplicates


@dataclasses.dataclass
class Sampling:
    temperature: float
    max_tokens: int
    seed: int | None = None
    top_p: float = 1.0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    stop: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion:
    text: str
    num_tokens: int
    finish_reason: str | None  # "stop" | "length" | ...


GenerateFn = Callable[[list[list[int]], list[Sampling]], list[Completion]]


def request_seeds(seed: int, phase: str, count: int) -> list[int]:
    """One seed per request: identical Magpie prompts must not all sample the same turn."""
    rng = random.Random(f"{seed}:{phase}")  # str seeds are hashed deterministically (not PYTHONHASHSEED)
    return [rng.randrange(2**31) for _ in range(count)]


@dataclasses.dataclass
class AnswerResult:
    conversations: list[PromptConversation]
    answers_generated: int
    empty_answers_dropped: int
    too_long_dropped: int
    truncated_answers: int
    prompt_tokens: int
    generated_tokens: int


def answer_conversations(
    tokenizer: Any,
    prompts: list[PromptConversation],
    generate: GenerateFn,
    *,
    max_tokens: int,
    max_model_len: int,
    temperature: float,
    seed: int,
    stop: StopSet | None = None,
) -> AnswerResult:
    """Fill every assistant slot with the target's answer, turn by turn (later turns see earlier answers).

    A conversation is dropped when an answer comes back empty, or when its prompt leaves no room for
    `max_tokens` within `max_model_len`. `stop` ends an answer at the template's end-of-turn.
    """
    conversations = [PromptConversation([dict(m) for m in p.messages], p.origin) for p in prompts]
    alive = [True] * len(conversations)
    counts: collections.Counter[str] = collections.Counter()
    slots = [[i for i, m in enumerate(c.messages) if m["role"] == "assistant"] for c in conversations]
    seeds = iter(request_seeds(seed, "answers", sum(len(s) for s in slots)))
    for round_index in range(max((len(s) for s in slots), default=0)):
        requests = _RoundRequests()
        for c, conversation in enumerate(conversations):
            if not alive[c] or round_index >= len(slots[c]):
                continue
            slot = slots[c][round_index]
            text = render(tokenizer, conversation.messages[:slot], add_generation_prompt=True)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(prompt_ids) + max_tokens > max_model_len:
                alive[c] = False
                counts["too_long"] += 1
                continue
            requests.add((c, slot), prompt_ids, _answer_sampling(temperature, max_tokens, next(seeds), stop))
            counts["prompt_tokens"] += len(prompt_ids)
        if requests.slots:
            log.info("answer round %d: %d requests", round_index + 1, len(requests.slots))
            _fill_slots(conversations, alive, counts, requests, generate(requests.ids, requests.sampling))
    return AnswerResult(
        conversations=[c for c, ok in zip(conversations, alive, strict=True) if ok],
        answers_generated=counts["answers"],
        empty_answers_dropped=counts["empty"],
        too_long_dropped=counts["too_long"],
        truncated_answers=counts["truncated"],
        prompt_tokens=counts["prompt_tokens"],
        generated_tokens=counts["generated_tokens"],
    )


@dataclasses.dataclass
class _RoundRequests:
    """One answering round's requests: which (conversation, slot) each answers, its prompt ids and sampling."""

    slots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    ids: list[list[int]] = dataclasses.field(default_factory=list)
    sampling: list[Sampling] = dataclasses.field(default_factory=list)

    def add(self, slot: tuple[int, int], prompt_ids: list[int], sampling: Sampling) -> None:
        self.slots.append(slot)
        self.ids.append(list(prompt_ids))
        self.sampling.append(sampling)


def _answer_sampling(temperature: float, max_tokens: int, seed: int, stop: StopSet | None) -> Sampling:
    return Sampling(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        stop_token_ids=list(stop.token_ids) if stop else [],
        stop=list(stop.strings) if stop else [],
    )


def _fill_slots(
    conversations: list[PromptConversation],
    alive: list[bool],
    counts: collections.Counter[str],
    requests: _RoundRequests,
    completions: list[Completion],
) -> None:
    """Write a round's answers into their slots; an empty answer drops its conversation."""
    for (c, slot), completion in zip(requests.slots, completions, strict=True):
        counts["answers"] += 1
        counts["generated_tokens"] += completion.num_tokens
        if not completion.text.strip():
            alive[c] = False
            counts["empty"] += 1
            continue
        counts["truncated"] += completion.finish_reason == "length"
        conversations[c].messages[slot]["content"] = completion.text


def to_sharegpt(conversation: PromptConversation, index: int) -> dict[str, Any]:
    return {
        "id": f"regenerated-{index}",
        "origin": conversation.origin,
        "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conversation.messages],
    }
