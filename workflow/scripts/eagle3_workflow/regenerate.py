"""Stage `regenerate_responses`: the target answers the prompts itself (self-distillation).

A draft learns to predict the target's own continuations, so the best training data is the target's answers, not
somebody else's. Prompts come from files (``.txt`` one prompt per line; ``.jsonl``/``.json`` records with ShareGPT
``conversations`` or OpenAI ``messages``, whose assistant turns are regenerated turn by turn) and/or from the
target itself, Magpie-style: the chat template's text up to a user message's content is given to the target,
which then writes a user turn. Prompts are deduplicated, answered with offline vLLM, and written as ShareGPT
JSONL (what ``prepare_data`` reads) plus a small stats file.

Process layout: Snakemake's ``script:`` directive makes the entry script ``__main__``, and vLLM's spawned
workers re-import ``__main__``; so the rule's adapter (``main``) starts ``python -m eagle3_workflow.regenerate``
as a runtime.ChildProcess (whose ``__main__`` is guarded) and streams its output into the rule's log; the
child dies with the stage, and a request must finish every ``vllm.stall_timeout_s`` once the engine is up.

Prompts are rendered with the tokenizer's chat template and tokenized here with ``add_special_tokens=False``,
exactly as ``prepare_data`` tokenizes the written conversations, and handed to vLLM as token ids: the target
sees the same tokens it will later be trained to predict after (no doubled BOS from vLLM's own tokenization).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.chat import ROLE_ALIASES, StopSet, assistant_stop_set, render
from eagle3_workflow.contracts import write_json_atomic
from eagle3_workflow.errors import StageError, render_table
from eagle3_workflow.runtime.child import ChildProcess, ProgressWatch
from eagle3_workflow.vllm_server import offline_engine_kwargs

log = logging.getLogger("eagle3.regenerate")

# Stands in for a user message's content to find where the template puts it; no template emits it itself.
CONTENT_SENTINEL = "MAGPIE_CONTENT_SENTINEL_7f3a9c"
SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}
MAX_REPORTED_BAD = 20
OUTPUT_TAIL_LINES = 40


# ----------------------------------------------------------------------------------------------- prompts


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
    if not isinstance(turns, list) or not turns:
        raise ValueError("conversation is empty or not a list")
    messages: list[dict[str, str]] = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise ValueError(f"turn {j} is not an object with '{role_key}' and '{content_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise ValueError(f"turn {j} has unknown role {turn[role_key]!r} (known: {sorted(ROLE_ALIASES)})")
        content = turn[content_key]
        if not isinstance(content, str):
            raise ValueError(f"turn {j} content is {type(content).__name__}, expected a string")
        messages.append({"role": role, "content": "" if role == "assistant" else content})
    return messages


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
    if path.suffix not in (".jsonl", ".json"):
        raise StageError(
            f"prompt file {path} has suffix {path.suffix!r}; use .txt (one prompt per line) or .jsonl/.json "
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


def _json_records(path: Path) -> list[tuple[int, Any]]:
    """(line or position, record) of a JSON array file or a JSON-lines file; every unparsable line is named."""
    text = path.read_text(encoding="utf-8")
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


# ------------------------------------------------------------------------------------------ magpie prompts


@dataclasses.dataclass
class UserTurnTemplate:
    """What the chat template writes around a (single, first) user message's content."""

    prefix: str  # everything before the content: default system prompt, BOS, the user header
    suffix: str  # everything after: the end-of-turn marker


def user_turn_template(tokenizer: Any) -> UserTurnTemplate:
    """Cut the rendering of one user message at its content: the Magpie prefix comes from the template itself."""
    rendered = render(tokenizer, [{"role": "user", "content": CONTENT_SENTINEL}], add_generation_prompt=False)
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


# ---------------------------------------------------------------------------------------------- generation


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
class MagpieResult:
    prompts: list[PromptConversation]
    dropped: dict[str, int]
    generated_tokens: int


def generate_magpie_prompts(
    tokenizer: Any, generate: GenerateFn, *, count: int, max_tokens: int, min_chars: int, temperature: float, seed: int
) -> MagpieResult:
    """Ask the target to write `count` user turns (sampled from the template's user prefix) and filter them."""
    template = user_turn_template(tokenizer)
    stop = end_of_turn_stop(tokenizer, template.suffix)
    prefix_ids = tokenizer(template.prefix, add_special_tokens=False)["input_ids"]
    sampling = [
        Sampling(
            temperature=temperature, max_tokens=max_tokens, seed=s, stop_token_ids=stop.token_ids, stop=stop.strings
        )
        for s in request_seeds(seed, "magpie", count)
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
            kept.append(PromptConversation(answer_slots([{"role": "user", "content": text}]), f"magpie:{i}"))
    return MagpieResult(kept, dict(dropped), sum(c.num_tokens for c in completions))


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
    counts = collections.Counter()
    slots = [[i for i, m in enumerate(c.messages) if m["role"] == "assistant"] for c in conversations]
    seeds = iter(request_seeds(seed, "answers", sum(len(s) for s in slots)))
    for round_index in range(max((len(s) for s in slots), default=0)):
        batch, ids, sampling = [], [], []
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
            batch.append((c, slot))
            ids.append(list(prompt_ids))
            sampling.append(
                Sampling(
                    temperature=temperature,
                    max_tokens=max_tokens,
                    seed=next(seeds),
                    stop_token_ids=list(stop.token_ids) if stop else [],
                    stop=list(stop.strings) if stop else [],
                )
            )
            counts["prompt_tokens"] += len(prompt_ids)
        if not batch:
            continue
        log.info("answer round %d: %d requests", round_index + 1, len(batch))
        for (c, slot), completion in zip(batch, generate(ids, sampling), strict=True):
            counts["answers"] += 1
            counts["generated_tokens"] += completion.num_tokens
            if not completion.text.strip():
                alive[c] = False
                counts["empty"] += 1
                continue
            counts["truncated"] += completion.finish_reason == "length"
            conversations[c].messages[slot]["content"] = completion.text
    return AnswerResult(
        conversations=[c for c, ok in zip(conversations, alive, strict=True) if ok],
        answers_generated=counts["answers"],
        empty_answers_dropped=counts["empty"],
        too_long_dropped=counts["too_long"],
        truncated_answers=counts["truncated"],
        prompt_tokens=counts["prompt_tokens"],
        generated_tokens=counts["generated_tokens"],
    )


def to_sharegpt(conversation: PromptConversation, index: int) -> dict[str, Any]:
    return {
        "id": f"regenerated-{index}",
        "origin": conversation.origin,
        "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conversation.messages],
    }


@dataclasses.dataclass
class RegenerationStats:
    """Written beside regenerated.jsonl: where every prompt went."""

    target: str
    prompts_read: dict[str, int]  # per prompt file
    magpie_requested: int
    magpie_generated: int  # kept after the filters
    magpie_dropped: dict[str, int]  # empty | unfinished | too_short
    magpie_prefix: str | None
    duplicates_dropped: int
    capped_by_max_prompts: int
    too_long_dropped: int
    answers_generated: int
    empty_answers_dropped: int
    truncated_answers: int  # kept, but cut at regenerate.max_tokens
    conversations_written: int
    prompt_tokens: int
    generated_tokens: int
    engine_ready_s: float
    generate_s: float
    generated_tokens_per_s: float
    settings: dict[str, Any]
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # where answers end (eos + end-of-turn)
    stop_strings: list[str] = dataclasses.field(default_factory=list)


def regenerate(
    tokenizer: Any,
    generate: GenerateFn,
    prompt_files: Sequence[Path],
    settings: dict[str, Any],
) -> tuple[list[dict[str, Any]], RegenerationStats]:
    """Read, generate (Magpie), deduplicate and answer; returns the ShareGPT records and the stats.

    `settings` is the config's regenerate section plus `max_model_len`. Pure apart from `generate`.
    """
    prompts_read: dict[str, int] = {}
    prompts: list[PromptConversation] = []
    for path in prompt_files:
        from_file = read_prompt_file(Path(path))
        prompts_read[str(path)] = len(from_file)
        prompts.extend(from_file)

    started = time.perf_counter()
    magpie = MagpieResult([], {}, 0)
    magpie_prefix = None
    if settings["magpie_prompts"] > 0:
        magpie_prefix = user_turn_template(tokenizer).prefix
        magpie = generate_magpie_prompts(
            tokenizer,
            generate,
            count=settings["magpie_prompts"],
            max_tokens=settings["magpie_max_tokens"],
            min_chars=settings["magpie_min_chars"],
            temperature=settings["magpie_temperature"],
            seed=settings["seed"],
        )
        log.info(
            "magpie: %d of %d generated user turns kept (dropped %s)",
            len(magpie.prompts),
            settings["magpie_prompts"],
            magpie.dropped,
        )
        for prompt in magpie.prompts[:5]:
            log.info("magpie example (%s): %r", prompt.origin, prompt.messages[0]["content"][:200])
        prompts.extend(magpie.prompts)

    unique, duplicates = deduplicate(prompts)
    capped = 0
    if settings.get("max_prompts") is not None and len(unique) > settings["max_prompts"]:
        capped = len(unique) - settings["max_prompts"]
        unique = unique[: settings["max_prompts"]]
    if not unique:
        raise StageError(
            f"no prompt to answer: {sum(prompts_read.values())} read from regenerate.prompt_files, "
            f"{len(magpie.prompts)} of {settings['magpie_prompts']} Magpie prompts kept (dropped {magpie.dropped}). "
            "Give prompt files, or raise regenerate.magpie_prompts / magpie_max_tokens"
        )
    log.info(
        "answering %d unique prompts (%d duplicates dropped, %d over max_prompts)", len(unique), duplicates, capped
    )
    stop = assistant_stop_set(tokenizer)
    log.info(
        "answers stop at token ids %s, strings %s (template end-of-turn %r)",
        stop.token_ids,
        stop.strings,
        stop.end_of_turn,
    )
    answered = answer_conversations(
        tokenizer,
        unique,
        generate,
        max_tokens=settings["max_tokens"],
        max_model_len=settings["max_model_len"],
        temperature=settings["temperature"],
        seed=settings["seed"],
        stop=stop,
    )
    generate_s = time.perf_counter() - started
    if not answered.conversations:
        raise StageError(
            f"the target answered none of {len(unique)} prompts usably ({answered.empty_answers_dropped} empty, "
            f"{answered.too_long_dropped} longer than vllm.max_model_len - regenerate.max_tokens). Check the "
            "target (its eos/chat template) in the log, and vllm.max_model_len"
        )
    generated_tokens = answered.generated_tokens + magpie.generated_tokens
    stats = RegenerationStats(
        target="",
        prompts_read=prompts_read,
        magpie_requested=settings["magpie_prompts"],
        magpie_generated=len(magpie.prompts),
        magpie_dropped=magpie.dropped,
        magpie_prefix=magpie_prefix,
        duplicates_dropped=duplicates,
        capped_by_max_prompts=capped,
        too_long_dropped=answered.too_long_dropped,
        answers_generated=answered.answers_generated,
        empty_answers_dropped=answered.empty_answers_dropped,
        truncated_answers=answered.truncated_answers,
        conversations_written=len(answered.conversations),
        prompt_tokens=answered.prompt_tokens,
        generated_tokens=generated_tokens,
        engine_ready_s=0.0,
        generate_s=round(generate_s, 2),
        generated_tokens_per_s=round(generated_tokens / generate_s, 1) if generate_s > 0 else 0.0,
        settings=dict(settings),
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )
    records = [to_sharegpt(c, i) for i, c in enumerate(answered.conversations)]
    return records, stats


def write_jsonl_atomic(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------- vLLM adapter


def engine_kwargs(target: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The regeneration engine from the config's target, vllm and extraction sections (served as in extraction)."""
    return offline_engine_kwargs(
        config["vllm"],
        model=str(target),
        dtype=config["target"]["dtype"],
        trust_remote_code=config["target"]["trust_remote_code"],
        seed=config["regenerate"]["seed"],
        tensor_parallel_size=config["extraction"]["tensor_parallel_size"],
        device=config["vllm"].get("device", "auto"),
    )


def vllm_generate_fn(llm: Any, chunk_size: int) -> GenerateFn:
    """Generate in chunks of `chunk_size` requests so that a long run logs its progress (and rate, ETA).

    Chunks several times vLLM's max_num_seqs keep the batch full for all but each chunk's tail.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_workflow.runtime.child import engine_progress_bar

    progress_bar = engine_progress_bar()  # a marker per finished request: the parent's stall watch

    def generate(prompt_ids: list[list[int]], sampling: list[Sampling]) -> list[Completion]:
        params = [
            SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_tokens,
                seed=s.seed,
                stop_token_ids=s.stop_token_ids or None,
                stop=s.stop or None,
            )
            for s in sampling
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        completions: list[Completion] = []
        started, tokens = time.perf_counter(), 0
        for begin in range(0, len(prompts), chunk_size):
            end = begin + chunk_size
            for output in llm.generate(prompts[begin:end], params[begin:end], use_tqdm=progress_bar):
                completion = output.outputs[0]
                completions.append(Completion(completion.text, len(completion.token_ids), completion.finish_reason))
                tokens += len(completion.token_ids)
            elapsed = time.perf_counter() - started
            done = len(completions)
            log.info(
                "generated %d/%d requests, %d tokens, %.0f tok/s, about %.0f s left",
                done,
                len(prompts),
                tokens,
                tokens / elapsed,
                elapsed / done * (len(prompts) - done),
            )
        return completions

    return generate


def run_regeneration(
    target: Path, prompt_files: Sequence[Path], output: Path, stats_path: Path, config: dict[str, Any]
) -> RegenerationStats:
    """The subprocess's work: start vLLM on the target, regenerate, write both outputs atomically."""
    from eagle3_workflow.chat import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(target, trust_remote_code=config["target"]["trust_remote_code"])
    if config["vllm"]["extra_args"]:
        log.warning(
            "vllm.extra_args %s are server flags; the offline engine here ignores them", config["vllm"]["extra_args"]
        )
    from eagle3_workflow.runtime.child import BUSY_MARKER, print_marker

    kwargs = engine_kwargs(target, config)
    log.info("starting vLLM: %s", kwargs)
    started = time.perf_counter()
    from vllm import LLM

    llm = LLM(**kwargs)
    ready_s = time.perf_counter() - started
    log.info("vLLM ready in %.1f s", ready_s)
    print_marker(BUSY_MARKER)  # from here on a request must finish every vllm.stall_timeout_s (or the pace's)
    settings = {**config["regenerate"], "max_model_len": config["vllm"]["max_model_len"]}
    chunk_size = max(64, 8 * config["vllm"]["max_num_seqs"])
    records, stats = regenerate(tokenizer, vllm_generate_fn(llm, chunk_size), prompt_files, settings)
    stats.target = str(target)
    stats.engine_ready_s = round(ready_s, 2)
    write_jsonl_atomic(output, records)
    write_json_atomic(stats_path, stats)
    log.info(
        "wrote %d conversations to %s; %d tokens generated in %.1f s (%.0f tok/s)",
        stats.conversations_written,
        output,
        stats.generated_tokens,
        stats.generate_s,
        stats.generated_tokens_per_s,
    )
    return stats


def _cli(argv: Sequence[str] | None = None) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    parser = argparse.ArgumentParser(prog="python -m eagle3_workflow.regenerate", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--prompt-file", action="append", default=[], type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--stats", required=True, type=Path)
    parser.add_argument("--config-json", required=True, help="the resolved config (JSON)")
    args = parser.parse_args(argv)
    config = json.loads(args.config_json)
    run_stage(
        "regenerate_responses (vLLM subprocess)",
        None,
        lambda _log: run_regeneration(args.target, args.prompt_file, args.output, args.stats, config),
    )


# ----------------------------------------------------------------------------------------- Snakemake adapter


# Snakemake sets these to the job's `threads` for every job. torch takes MKL_NUM_THREADS over OMP_NUM_THREADS,
# so vLLM's CPU worker, which vLLM pins to the cores it binds (on a 2-core host: one core, the other reserved
# for the engine), ran 2 threads on that one core: measured here, 64 requests x 96 tokens took > 300 s instead
# of 9 s (30x slower or worse, spin-waiting). Without them vLLM sizes each worker's threads to its cores.
def subprocess_env(config: dict[str, Any]) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    # vLLM's CPU workers set their own torch threads from their core binding; cpu_threads is the engine's
    return child_environment(vllm_on_cpu=True, cpu_threads=config["vllm"]["cpu_threads"])


def run_subprocess(
    target: Path,
    prompt_files: Sequence[Path],
    output: Path,
    stats_path: Path,
    config: dict[str, Any],
    logger: logging.Logger,
) -> None:
    """Run the regeneration in `python -m eagle3_workflow.regenerate`, every output line into `logger`."""
    cmd = [
        sys.executable,
        "-m",
        "eagle3_workflow.regenerate",
        "--target",
        str(target),
        "--output",
        str(output),
        "--stats",
        str(stats_path),
        "--config-json",
        json.dumps(config),
    ]
    for path in prompt_files:
        cmd += ["--prompt-file", str(path)]
    logger.info("running: %s", " ".join(cmd[:4] + ["..."]))
    child = ChildProcess(
        cmd,
        name="the regeneration subprocess",
        env=subprocess_env(config),
        on_line=lambda line: logger.info("| %s", line),
        progress=ProgressWatch(floor_s=config["vllm"]["stall_timeout_s"]),
        tail_lines=OUTPUT_TAIL_LINES,
    )
    with child:
        returncode = child.wait()
    if returncode != 0:
        raise StageError(
            child.failure_text(f"the regeneration subprocess exited with status {returncode}", where="above")
            + "\nA vLLM start-up failure usually means the vllm section (max_model_len, kv_cache_memory_bytes) "
            "does not fit the target or the machine"
        )
    missing = [str(p) for p in (output, stats_path) if not p.exists()]
    if missing:
        raise StageError(f"the regeneration subprocess succeeded but did not write {missing}; this is a bug")


def main(snakemake: Any) -> None:
    from eagle3_workflow.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        run_subprocess(
            Path(snakemake.input.target),
            [Path(p) for p in snakemake.input.prompt_files],
            Path(snakemake.output.conversations),
            Path(snakemake.output.stats),
            dict(snakemake.params.settings),
            log,
        )

    run_stage("regenerate_responses", snakemake.log[0], body)


if __name__ == "__main__":  # vLLM's spawned workers re-import __main__: the guard keeps them from re-running it
    _cli()
