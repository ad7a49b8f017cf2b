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

    from eagle3_workflow.errors import StageError

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


def normalize_messages(turns: list[dict[str, Any]], *, role_key: str, content_key: str) -> list[dict[str, str]]:
    """Map ShareGPT/OpenAI turns to [{role, content}] with canonical roles; raise ValueError on bad turns."""
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
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("conversation has no assistant turn")
    return out
