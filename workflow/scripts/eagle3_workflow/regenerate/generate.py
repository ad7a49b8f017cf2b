"""The regeneration worker: `python -m eagle3_workflow.regenerate.generate --spec S --result R` (the stage's only
`-m` entry, run through runtime.worker).

Snakemake's ``script:`` directive makes the entry script ``__main__``, and vLLM's spawned workers re-import
``__main__``; so the stage (stage.py) runs this module as a worker, whose ``__main__`` is guarded. It reads its
RegenerationSpec (protocol.py), starts offline vLLM on the target, runs `regenerate` (read, Magpie, deduplicate,
answer), writes the ShareGPT JSONL atomically and returns the stats, which runtime.worker writes as its result.
vLLM is imported only inside the functions that start it.

Prompts are rendered with the tokenizer's chat template and tokenized with ``add_special_tokens=False``, exactly
as ``prepare_data`` tokenizes the written conversations, and handed to vLLM as token ids: the target sees the same
tokens it will later be trained to predict after (no doubled BOS from vLLM's own tokenization).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.chat import StopSet, assistant_stop_set
from eagle3_workflow.files.data_artefacts import RegenerationStats
from eagle3_workflow.regenerate.magpie import MagpieResult, generate_magpie_prompts
from eagle3_workflow.regenerate.prompts import (
    AnswerResult,
    Completion,
    GenerateFn,
    PromptConversation,
    Sampling,
    answer_conversations,
    deduplicate,
    read_prompt_file,
    to_sharegpt,
)
from eagle3_workflow.regenerate.protocol import RegenerationSpec
from eagle3_workflow.serving.engine import cpu_engine_in_one_process, generation_cuda_graphs, offline_engine_kwargs
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import RegenerateSettings
from eagle3_workflow.settings.stages import RegenerateResponsesStage
from eagle3_workflow.settings.views import as_config

log = logging.getLogger("eagle3.regenerate")


def regenerate(
    tokenizer: Any,
    generate: GenerateFn,
    prompt_files: Sequence[Path],
    settings: RegenerateSettings,
    *,
    max_model_len: int,
) -> tuple[list[dict[str, Any]], RegenerationStats]:
    """Read, generate (Magpie), deduplicate and answer; returns the ShareGPT records and the stats.

    `settings`: the config's regenerate section; `max_model_len`: vllm's. Pure apart from `generate`.
    """
    prompts_read, prompts = _read_prompt_files(prompt_files)
    started = time.perf_counter()
    magpie, per_set = _magpie_prompts(tokenizer, generate, settings)
    prompts.extend(magpie.prompts)
    unique, duplicates = deduplicate(prompts)
    capped = 0
    if settings.max_prompts is not None and len(unique) > settings.max_prompts:
        capped = len(unique) - settings.max_prompts
        unique = unique[: settings.max_prompts]
    if not unique:
        raise StageError(
            f"no prompt to answer: {sum(prompts_read.values())} read from regenerate.prompt_files, "
            f"{len(magpie.prompts)} of {sum(s['requested'] for s in per_set.values())} Magpie prompts kept "
            f"(dropped {magpie.dropped}). Give prompt files, or raise regenerate.magpie_prompts / magpie_max_tokens"
        )
    log.info(
        "answering %d unique prompts (%d duplicates dropped, %d over max_prompts)", len(unique), duplicates, capped
    )
    answered, stop = _answer(tokenizer, unique, generate, settings, max_model_len)
    generate_s = time.perf_counter() - started
    if not answered.conversations:
        raise StageError(
            f"the target answered none of {len(unique)} prompts usably ({answered.empty_answers_dropped} empty, "
            f"{answered.too_long_dropped} longer than vllm.max_model_len - regenerate.max_tokens). Check the "
            "target (its eos/chat template) in the log, and vllm.max_model_len"
        )
    # the stats record the section as the config gave it, plus the engine's length limit
    recorded = as_config(settings) | {"max_model_len": max_model_len}
    stats = _stats(
        answered,
        stop,
        recorded=recorded,
        prompts_read=prompts_read,
        magpie=magpie,
        per_set=per_set,
        generate_s=generate_s,
    )
    stats.duplicates_dropped, stats.capped_by_max_prompts = duplicates, capped
    records = [to_sharegpt(c, i) for i, c in enumerate(answered.conversations)]
    return records, stats


def _read_prompt_files(prompt_files: Sequence[Path]) -> tuple[dict[str, int], list[PromptConversation]]:
    """Every prompt file's prompts in order, and how many each gave (for the stats)."""
    prompts_read: dict[str, int] = {}
    prompts: list[PromptConversation] = []
    for path in prompt_files:
        from_file = read_prompt_file(Path(path))
        prompts_read[str(path)] = len(from_file)
        prompts.extend(from_file)
    return prompts_read, prompts


def magpie_sets(settings: RegenerateSettings) -> list[tuple[str, int, str | None]]:
    """(stream, count, system prompt) of every Magpie set the settings ask for: the unsteered `magpie` set
    (magpie_prompts), then each of regenerate.magpie_steered as `magpie[<name>]`. Pure."""
    names = [steer.name for steer in settings.magpie_steered]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise StageError(
            f"regenerate.magpie_steered names {repeated} more than once: each set's name is its prompts' origin "
            "and its seed stream; give every set a name of its own"
        )
    sets: list[tuple[str, int, str | None]] = []
    if settings.magpie_prompts > 0:
        sets.append(("magpie", settings.magpie_prompts, None))
    sets += [(f"magpie[{s.name}]", s.prompts, s.system_prompt) for s in settings.magpie_steered]
    return sets


def _magpie_prompts(
    tokenizer: Any, generate: GenerateFn, settings: RegenerateSettings
) -> tuple[MagpieResult, dict[str, dict[str, Any]]]:
    """Every Magpie set's prompts (none when no set is asked for), together, and each set's own record."""
    together = MagpieResult([], {}, 0)
    per_set: dict[str, dict[str, Any]] = {}
    for stream, count, system_prompt in magpie_sets(settings):
        magpie = generate_magpie_prompts(
            tokenizer,
            generate,
            count=count,
            max_tokens=settings.magpie_max_tokens,
            min_chars=settings.magpie_min_chars,
            temperature=settings.magpie_temperature,
            seed=settings.seed,
            system_prompt=system_prompt,
            stream=stream,
        )
        log.info(
            "%s: %d of %d generated user turns kept (dropped %s)", stream, len(magpie.prompts), count, magpie.dropped
        )
        for prompt in magpie.prompts[:5]:
            log.info("%s example (%s): %r", stream, prompt.origin, prompt.messages[0]["content"][:200])
        per_set[stream] = {
            "requested": count,
            "kept": len(magpie.prompts),
            "dropped": magpie.dropped,
            "prefix": magpie.prefix,
            "system_prompt": system_prompt,
        }
        together.prompts.extend(magpie.prompts)
        together.generated_tokens += magpie.generated_tokens
        for reason, dropped in magpie.dropped.items():
            together.dropped[reason] = together.dropped.get(reason, 0) + dropped
    return together, per_set


def _answer(
    tokenizer: Any,
    unique: list[PromptConversation],
    generate: GenerateFn,
    settings: RegenerateSettings,
    max_model_len: int,
) -> tuple[AnswerResult, StopSet]:
    """Answer every prompt, stopping each answer where the chat template ends an assistant turn."""
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
        max_tokens=settings.max_tokens,
        max_model_len=max_model_len,
        temperature=settings.temperature,
        seed=settings.seed,
        stop=stop,
    )
    return answered, stop


def _stats(
    answered: AnswerResult,
    stop: StopSet,
    *,
    recorded: dict[str, Any],
    prompts_read: dict[str, int],
    magpie: MagpieResult,
    per_set: dict[str, dict[str, Any]],
    generate_s: float,
) -> RegenerationStats:
    """The stats of a regeneration; the caller fills in what happened between reading and answering."""
    generated_tokens = answered.generated_tokens + magpie.generated_tokens
    return RegenerationStats(
        target="",
        prompts_read=prompts_read,
        magpie_requested=sum(s["requested"] for s in per_set.values()),
        magpie_generated=len(magpie.prompts),
        magpie_dropped=magpie.dropped,
        magpie_prefix=per_set["magpie"]["prefix"] if "magpie" in per_set else None,
        magpie_sets=per_set,
        duplicates_dropped=0,
        capped_by_max_prompts=0,
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
        settings=recorded,
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )


def write_jsonl_atomic(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def regeneration_engine_kwargs(target: Path, settings: RegenerateResponsesStage) -> dict[str, Any]:
    """The regeneration engine from the stage's target, vllm and extraction settings (served as in extraction);
    CUDA graphs on a GPU (vllm.generation_cuda_graphs: a small target's decode step is launch-bound)."""
    kwargs = offline_engine_kwargs(
        settings.vllm,
        model=str(target),
        dtype=settings.target.dtype,
        trust_remote_code=settings.target.trust_remote_code,
        seed=settings.regenerate.seed,
        tensor_parallel_size=settings.extraction.tensor_parallel_size,
        device=settings.vllm.device,
        tensor_parallel_setting="extraction.tensor_parallel_size",
    )
    if generation_cuda_graphs(settings.vllm, settings.vllm.device):
        kwargs["enforce_eager"] = False
    if cpu_engine_in_one_process(settings.vllm.device, kwargs["tensor_parallel_size"]):
        kwargs["distributed_executor_backend"] = "uni"  # with subprocess_env's VLLM_ENABLE_V1_MULTIPROCESSING=0
    return kwargs


def vllm_generate_fn(llm: Any, chunk_size: int) -> GenerateFn:
    """Generate in chunks of `chunk_size` requests so that a long run logs its progress (and rate, ETA).

    Chunks several times vLLM's max_num_seqs keep the batch full for all but each chunk's tail.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_workflow.runtime.worker import engine_progress_bar

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


def run_regeneration(spec: RegenerationSpec) -> RegenerationStats:
    """The worker's work: start vLLM on the target, regenerate, write the conversations atomically; the stats."""
    from eagle3_workflow.files.chat import load_chat_tokenizer
    from eagle3_workflow.runtime.worker import report_busy
    from eagle3_workflow.serving.cpu_server import freeze_heap_for_cpu_engine

    target, settings, output = Path(spec.target), spec.settings, Path(spec.output)
    tokenizer = load_chat_tokenizer(target, trust_remote_code=settings.target.trust_remote_code)
    if settings.vllm.extra_args:
        log.warning(
            "vllm.extra_args %s are server flags; the offline engine here ignores them", list(settings.vllm.extra_args)
        )
    kwargs = regeneration_engine_kwargs(target, settings)
    log.info("starting vLLM: %s", kwargs)
    started = time.perf_counter()
    from vllm import LLM

    freeze_heap_for_cpu_engine(kwargs["tensor_parallel_size"])  # start-up collections skip the imports' objects
    llm = LLM(**kwargs)
    ready_s = time.perf_counter() - started
    log.info("vLLM ready in %.1f s", ready_s)
    report_busy()  # from here on a request must finish every vllm.stall_timeout_s (or the pace's)
    chunk_size = max(64, 8 * settings.vllm.max_num_seqs)
    prompt_files = [Path(p) for p in spec.prompt_files]
    records, stats = regenerate(tokenizer, vllm_generate_fn(llm, chunk_size), prompt_files, settings.regenerate,
                                max_model_len=settings.vllm.max_model_len)  # fmt: skip
    stats.target = str(target)
    stats.engine_ready_s = round(ready_s, 2)
    write_jsonl_atomic(output, records)
    log.info(
        "wrote %d conversations to %s; %d tokens generated in %.1f s (%.0f tok/s)",
        stats.conversations_written,
        output,
        stats.generated_tokens,
        stats.generate_s,
        stats.generated_tokens_per_s,
    )
    return stats


if __name__ == "__main__":  # vLLM's spawned workers re-import __main__: the guard keeps them from re-running it
    from eagle3_workflow.runtime.worker import serve

    serve(RegenerationSpec, run_regeneration, name="regenerate_responses (vLLM worker)")
