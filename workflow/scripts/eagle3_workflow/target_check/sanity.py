"""Stage `check_target`: does the target answer through its chat template, before it writes training data?

Self-distillation trains the draft on the target's own answers. A base (not instruct) checkpoint renders
through a chat template just fine but answers nothing, or repeats the question: every regenerated record is
then garbage and nothing downstream notices (the draft learns to predict garbage, acceptance even looks good).
This stage asks the served target a few fixed questions greedily, through /v1/chat/completions (the chat
template applied by vLLM, as regeneration applies it) and refuses when an answer is empty or an echo of
the prompt. Writes checks/target_sanity.json; `regenerate_responses` takes it as input.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from eagle3_workflow.files.chat import assistant_stop_set, load_chat_tokenizer
from eagle3_workflow.files.target_artefacts import SanityAnswer, TargetSanityReport
from eagle3_workflow.settings.errors import StageError, render_table
from eagle3_workflow.settings.stages import CheckTargetStage

log = logging.getLogger("eagle3.check_target")

# Short, unambiguous questions any instruct model answers with something other than the question.
SANITY_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the sum of two numbers.",
    "Name three colours of the rainbow.",
]
MIN_ECHO_CHARS = 12  # an answer this short that appears in the prompt is a fragment, not necessarily an echo


def _normalized(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.casefold()).split())


def answer_problem(prompt: str, answer: str) -> str | None:
    """Why `answer` is not an answer to `prompt` (empty, or an echo of the prompt), or None. Pure."""
    said, asked = _normalized(answer), _normalized(prompt)
    if not said:
        return "empty answer (only whitespace, punctuation or the end-of-turn token)"
    if said.startswith(asked):
        return "echoes the prompt"
    if len(said) >= MIN_ECHO_CHARS and said in asked:
        return "repeats part of the prompt"
    return None


def judge(
    target: str, max_tokens: int, stop_token_ids: list[int], answers: list[tuple[str, str, str | None]]
) -> TargetSanityReport:
    """The report for (prompt, answer, finish_reason) triples: passed only when every answer is usable."""
    judged = [SanityAnswer(prompt=p, answer=a, finish_reason=f, problem=answer_problem(p, a)) for p, a, f in answers]
    return TargetSanityReport(
        passed=bool(judged) and all(a.problem is None for a in judged),
        target=target,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids,
        answers=judged,
    )


def failure_message(report: TargetSanityReport) -> str:
    rows = [(a.prompt, repr(a.answer[:200]), a.problem or "ok") for a in report.answers]
    bad = sum(a.problem is not None for a in report.answers)
    return (
        f"the target at {report.target} did not answer {bad} of {len(report.answers)} fixed questions through its "
        f"chat template (greedy, {report.max_tokens} tokens):\n"
        f"{render_table(['prompt', 'answer', 'verdict'], rows)}\n"
        "Self-distillation would train the draft on these answers. Is target.path a base (not instruct) "
        "checkpoint, or is its chat template / generation_config wrong? Use the instruct checkpoint; if the "
        "answers above are in fact fine, set target_check.enabled: false."
    )


def ask(
    server: Any, prompt: str, max_tokens: int, stop_token_ids: list[int], timeout_s: float
) -> tuple[str, str | None]:
    """One greedy chat completion (the server applies the chat template)."""
    import httpx

    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        headers=server.headers(),
        timeout=timeout_s,
        json={
            "model": server.spec.served_model_name,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stop_token_ids": stop_token_ids,
        },
    )
    if response.status_code != 200:
        raise StageError(f"/v1/chat/completions answered HTTP {response.status_code}: {response.text[:500]}")
    choice = response.json()["choices"][0]
    return choice["message"].get("content") or "", choice.get("finish_reason")


def server_spec(settings: CheckTargetStage, target: str, device: str) -> Any:
    """A plain server (no speculative config): the target as regeneration serves it, kept small on CPU."""
    from eagle3_workflow.serving.engine import target_server_spec

    spec = target_server_spec(settings, model=target, device=device)
    return dataclasses.replace(spec, max_num_seqs=len(SANITY_PROMPTS))


def check_target(settings: CheckTargetStage, target: str, device: str, log_path: str | Path) -> TargetSanityReport:
    from eagle3_workflow.serving.server import VLLMServer

    questions = settings.target_check
    tokenizer = load_chat_tokenizer(target, trust_remote_code=settings.target.trust_remote_code)
    stop = assistant_stop_set(tokenizer)
    answers = []
    with VLLMServer(server_spec(settings, target, device), log_path) as server:
        for prompt in SANITY_PROMPTS:
            text, finish = ask(server, prompt, questions.max_tokens, stop.token_ids, questions.request_timeout_s)
            log.info("asked %r; answer %r (%s)", prompt, text[:200], finish)
            answers.append((prompt, text, finish))
    return judge(target, questions.max_tokens, stop.token_ids, answers)
