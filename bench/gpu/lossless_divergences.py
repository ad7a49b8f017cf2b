"""How a speculative run's greedy outputs diverge from the reference's, read from evaluate_draft's saved lossless runs
(<run>/eval/work/runs/<label>.lossless.json, or .json.gz as committed under bench/gpu/results/), with the stage's
own functions (evaluation/lossless.py): prompts that differ, each first divergence's logit gap in dtype steps in
both runs, tokens that were not their own run's argmax, and how many steps before the first divergence had
bitwise-equal top logits. It answers "what evaluate.lossless_tie_steps would this backend need", from numbers.

    python3 bench/gpu/lossless_divergences.py REFERENCE.lossless.json CANDIDATE.lossless.json --out summary.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.evaluation.lossless import compare_greedy, non_argmax_steps  # noqa: E402
from eagle3_workflow.evaluation.protocol import RunResult  # noqa: E402


def read_run(path: Path) -> RunResult:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return RunResult.model_validate(json.load(handle))


def bitwise_equal_steps(reference: RunResult, candidate: RunResult) -> tuple[int, int]:
    """(steps before each prompt's first divergence, of which the top logits are bitwise equal in both runs)."""
    steps = equal = 0
    for ref_ids, cand_ids, ref_top, cand_top in zip(
        reference.outputs, candidate.outputs, reference.top_logits, candidate.top_logits, strict=True
    ):
        for position, (a, b) in enumerate(zip(ref_top, cand_top, strict=False)):
            if ref_ids[: position + 1] != cand_ids[: position + 1]:
                break
            steps += 1
            equal += a == b
    return steps, equal


def summarise(reference: RunResult, candidate: RunResult, dtype: str) -> dict:
    mismatches = compare_greedy(
        (reference.outputs, reference.top_logits),
        (candidate.outputs, candidate.top_logits),
        origins=[str(i) for i in range(len(reference.outputs))],
        dtype=dtype,
        tie_steps=0,
    )
    gaps = collections.Counter(
        f"{m.reference_gap_steps} / {m.candidate_gap_steps}" for m in mismatches
    )  # reference run's gap / candidate run's gap, in dtype steps
    worst = max(
        (max(m.reference_gap_steps, m.candidate_gap_steps) for m in mismatches
         if m.reference_gap_steps is not None and m.candidate_gap_steps is not None),
        default=None,
    )  # fmt: skip
    steps, equal = bitwise_equal_steps(reference, candidate)
    return {
        "reference": reference.label,
        "candidate": candidate.label,
        "numerics": [reference.numerics, candidate.numerics],
        "prompts": len(reference.outputs),
        "prompts_differing": len(mismatches),
        "first_divergence_gaps_in_steps": dict(gaps.most_common()),
        "gap_missing_from_top_k": sum(
            m.reference_gap_steps is None or m.candidate_gap_steps is None for m in mismatches
        ),
        "worst_gap_in_steps": worst,
        "non_argmax_tokens": {
            reference.label: len(non_argmax_steps(reference.outputs, reference.top_logits, "bfloat16")),
            candidate.label: len(non_argmax_steps(candidate.outputs, candidate.top_logits, "bfloat16")),
        },
        "steps_before_divergence": steps,
        "steps_with_bitwise_equal_top_logits": equal,
        "generated_tokens": [reference.generated_tokens, candidate.generated_tokens],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("candidate", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    summary = summarise(read_run(args.reference), read_run(args.candidate), args.dtype)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
