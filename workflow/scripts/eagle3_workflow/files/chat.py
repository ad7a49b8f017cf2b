"""Chat rendering and the assistant-only loss mask.

The mask is computed by rendering the conversation turn by turn and diffing the rendered *text*: for each
assistant turn i, the characters between render(messages[:i], add_generation_prompt=True) and
render(messages[:i+1]) are that turn's output (content plus the template's end-of-turn marker, which the draft
must learn to predict). The full text is then tokenized once with character offsets, and a token is trained on
when it starts inside such a span. This works for templates with or without ``{% generation %}`` and does not
depend on tokenization being prefix-stable at turn boundaries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}


class TemplateError(ValueError):
    """The tokenizer's chat template does not behave as a loss mask needs (reason in the message)."""


@dataclasses.dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    text: str

    @property
    def assistant_tokens(self) -> int:
        return sum(self.loss_mask)


def load_chat_tokenizer(target: Any, *, trust_remote_code: bool) -> Any:
    """The target's tokenizer; a StageError when it has no chat template (every stage that renders needs one)."""
    from transformers import AutoTokenizer

    from eagle3_workflow.settings.errors import StageError

    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        raise StageError(
            f"the target tokenizer at {target} has no chat template; add one "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )
    return tokenizer


def render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise TemplateError(
            f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str; "
            "this transformers version changed the API - pin transformers as in envs/"
        )
    return text


def assistant_char_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the [start, end) character spans the assistant produced."""
    full = render(tokenizer, messages, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not through.startswith(before):
            raise TemplateError(
                f"turn {i}: rendering up to the assistant turn is not a prefix of rendering through it "
                "(the template rewrites earlier text when a turn is added); use a template with "
                "{% generation %} markers or pre-tokenized input_ids/loss_mask"
            )
        if not full.startswith(through):
            raise TemplateError(
                f"turn {i}: the rendering through this turn is not a prefix of the whole conversation "
                "(the template renders earlier assistant turns differently once later turns exist, e.g. "
                "it strips reasoning); train on single-turn records or provide pre-tokenized data"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> TokenizedConversation:
    """input_ids exactly as a server renders them (template text, no extra special tokens) and the mask."""
    text, spans = assistant_char_spans(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoded["input_ids"])
    mask = []
    for start, end in encoded["offset_mapping"]:
        inside = any(span_start <= start < span_end for span_start, span_end in spans) and end > start
        mask.append(1 if inside else 0)
    return TokenizedConversation(input_ids=input_ids, loss_mask=mask, text=text)


def normalize_messages(
    turns: list[dict[str, Any]], *, role_key: str, content_key: str, require_assistant: bool = True
) -> list[dict[str, str]]:
    """Map ShareGPT/OpenAI turns to [{role, content}] with canonical roles; raise ValueError on bad turns.

    Training records need an assistant turn to learn from; prompts to answer (require_assistant=False) need none.
    """
    if not isinstance(turns, list) or not turns:
        raise ValueError("conversation is empty or not a list")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {j} is {type(turn).__name__}, expected an object")
        if role_key not in turn or content_key not in turn:
            raise ValueError(f"turn {j} lacks '{role_key}' or '{content_key}' (keys: {sorted(turn)})")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"turn {j} has unknown role {turn[role_key]!r} (known: {sorted(ROLE_ALIASES)})")
        content = turn[content_key]
        if not isinstance(content, str):
            raise ValueError(f"turn {j} content is {type(content).__name__}, expected a string")
        out.append({"role": role, "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in out):
        raise ValueError("conversation has no assistant turn")
    return out


ANSWER_SENTINEL = "EAGLE3ANSWERSENTINEL"


@dataclasses.dataclass
class StopSet:
    """Where a generated assistant turn ends: token ids (eos and the template's end-of-turn) and strings."""

    token_ids: list[int]
    strings: list[str]
    end_of_turn: str  # the text the template writes after an assistant message ("" if nothing)


def assistant_end_of_turn(tokenizer: Any) -> str:
    """The text the chat template writes right after an assistant message's content, up to the next turn."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER_SENTINEL}]
    text = render(tokenizer, messages, add_generation_prompt=False)
    if text.count(ANSWER_SENTINEL) != 1:
        raise TemplateError(
            f"the chat template rendered an assistant message's content {text.count(ANSWER_SENTINEL)} times "
            "(expected once); its end-of-turn cannot be derived"
        )
    return text.split(ANSWER_SENTINEL, 1)[1]


def assistant_stop_set(tokenizer: Any, extra_eos_ids: list[int] | tuple[int, ...] = ()) -> StopSet:
    """Stop tokens for an assistant answer, from the template's end-of-turn (not only generation_config's eos).

    A converted checkpoint may list only `eos` while its template ends a turn with another token (Gemma's
    `<end_of_turn>`): generation would then run past the turn. The end-of-turn is the first token of what the
    template writes after the answer; a special token is a stop token, plain text a stop string.
    """
    ids = {int(i) for i in extra_eos_ids}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    after = assistant_end_of_turn(tokenizer)
    marker = after.strip()
    strings: list[str] = []
    if marker:
        first = tokenizer(marker, add_special_tokens=False)["input_ids"][0]
        if (
            first in set(tokenizer.all_special_ids)
            or tokenizer.convert_ids_to_tokens(first) in tokenizer.get_added_vocab()
        ):
            ids.add(int(first))
        else:
            strings.append(marker.splitlines()[0])
    return StopSet(sorted(ids), strings, after)
