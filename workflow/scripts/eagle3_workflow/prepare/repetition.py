"""How much an answer repeats itself: the measure behind `data.max_repeated_share` (stdlib only, so that
bench/gpu/cut_answers.py reads a restore bundle with the same measure on a machine without the workflow's stack).

`repeated_share` is the share of an answer's 8-word spans that already occurred earlier in the same answer: 0 for
prose or code that never repeats itself, near 1 for a greedy loop. On the SmolLM2 GPU preset's regenerated data
(bench/gpu/results/2026-12-03-smollm2-135m-gpu-python/cut_answers.json) the answers cut at the 384-token cap have a
median of 0.492 and the finished ones 0.0; 2,330 of 4,774 cut answers are over 0.5, 73 of 5,817 finished ones.
"""

from __future__ import annotations

SPAN_WORDS = 8


def repeated_share(text: str, span: int = SPAN_WORDS) -> float:
    """Share of the text's `span`-word windows that already occurred earlier in it (0 when it has none)."""
    words = text.split()
    windows = [" ".join(words[i : i + span]) for i in range(len(words) - span + 1)]
    seen: set[str] = set()
    repeats = 0
    for window in windows:
        repeats += window in seen
        seen.add(window)
    return repeats / len(windows) if windows else 0.0


def most_repeated_answer(messages: list[dict[str, str]]) -> float:
    """The largest `repeated_share` over a conversation's assistant turns (0.0 without any)."""
    return max((repeated_share(m["content"]) for m in messages if m["role"] == "assistant"), default=0.0)
