"""Magpie prompts: the target writes user turns itself, sampled from its chat template's user prefix.

The chat template's text up to a user message's content is given to the target, which then writes a user turn;
the turn ends where the template ends one. Pure: the target is reached only through the `GenerateFn` it is given.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from eagle3_workflow.files.chat import render
from eagle3_workflow.regenerate.prompts import GenerateFn, PromptConversation, Sampling, answer_slots, request_seeds
from eagle3_workflow.settings.errors import StageError

# Stands in for a user message's content to find where the template puts it; no template emits it itself.
CONTENT_SENTINEL = "MAGPIE_CONTENT_SENTINEL_7f3a9c"


@dataclasses.dataclass
class UserTurnTemplate:
    """What the chat template writes around a (single, first) user message's content."""

    prefix: str  # everything before the content: default system prompt, BOS, the user header
    suffix: str  # everything after: the end-of-turn marker


def user_turn_template(tokenizer: Any, system_prompt: str | None = None) -> UserTurnTemplate:
    """Cut the rendering of one user message at its content: the Magpie prefix comes from the template itself.

    With `system_prompt`, the message follows that system message (a steered set, regenerate.magpie_steered)."""
    messages = [{"role": "user", "content": CONTENT_SENTINEL}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    rendered = render(tokenizer, messages, add_generation_prompt=False)
    if rendered.count(CONTENT_SENTINEL) != 1:
        raise StageError(
            f"the chat template rendered a user message's content {rendered.count(CONTENT_SENTINEL)} times "
            f"(expected once): {rendered[:300]!r}; Magpie prompts need a template that places the content once. "
            "Set regenerate.magpie_prompts: 0 and give regenerate.prompt_files instead"
        )
    prefix, suffix = rendered.split(CONTENT_SENTINEL)
    if not prefix.strip():
        raise StageError(
            "the chat template puts nothing before a user message's content (no role header), so the target "
            "cannot be asked to write a user turn; set regenerate.magpie_prompts: 0"
        )
    if system_prompt is not None and system_prompt.strip() not in prefix:
        raise StageError(
            f"the chat template does not place a system message before the user turn (rendered prefix "
            f"{prefix[:300]!r}), so regenerate.magpie_steered cannot steer what the target asks; remove "
            "regenerate.magpie_steered, or give prompt files of the domain in regenerate.prompt_files"
        )
    return UserTurnTemplate(prefix=prefix, suffix=suffix)


@dataclasses.dataclass
class StopCondition:
    token_ids: list[int]
    strings: list[str]


def end_of_turn_stop(tokenizer: Any, suffix: str) -> StopCondition:
    """Stop a generated user turn where the template ends one: a single special token, else the marker text."""
    marker = suffix.strip()
    token_ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        token_ids.append(int(tokenizer.eos_token_id))
    if not marker:
        return StopCondition(token_ids, [])
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    if len(ids) == 1:
        return StopCondition(sorted(set(token_ids + [int(ids[0])])), [])
    return StopCondition(token_ids, [marker])


@dataclasses.dataclass
class MagpieResult:
    prompts: list[PromptConversation]
    dropped: dict[str, int]
    generated_tokens: int
    prefix: str | None = None  # the text the turns were sampled after


def generate_magpie_prompts(
    tokenizer: Any,
    generate: GenerateFn,
    *,
    count: int,
    max_tokens: int,
    min_chars: int,
    temperature: float,
    seed: int,
    system_prompt: str | None = None,
    stream: str = "magpie",
) -> MagpieResult:
    """Ask the target to write `count` user turns (sampled from the template's user prefix) and filter them.

    `system_prompt` steers the turns (the prefix renders it before the user header); only the user turn is kept, so
    its answer is later generated under the template's default, as the prompt is served. `stream` names the set:
    each kept prompt's origin is `<stream>:<i>`, and its seeds are a stream of their own."""
    template = user_turn_template(tokenizer, system_prompt)
    stop = end_of_turn_stop(tokenizer, template.suffix)
    prefix_ids = tokenizer(template.prefix, add_special_tokens=False)["input_ids"]
    sampling = [
        Sampling(
            temperature=temperature, max_tokens=max_tokens, seed=s, stop_token_ids=stop.token_ids, stop=stop.strings
        )
        for s in request_seeds(seed, stream, count)
    ]
    completions = generate([list(prefix_ids)] * count, sampling)
    kept, dropped = [], collections.Counter()
    for i, completion in enumerate(completions):
        text = completion.text.strip()
        if not text:
            dropped["empty"] += 1
        elif completion.finish_reason == "length":
            dropped["unfinished"] += 1  # cut at magpie_max_tokens: a question without its end
        elif len(text) < min_chars:
            dropped["too_short"] += 1
        else:
            kept.append(PromptConversation(answer_slots([{"role": "user", "content": text}]), f"{stream}:{i}"))
    return MagpieResult(kept, dict(dropped), sum(c.num_tokens for c in completions), template.prefix)
