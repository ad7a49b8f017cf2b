"""What the answers cut at regenerate.max_tokens are, read from a restore bundle (issue #43): long answers, or loops.

    python3 bench/gpu/cut_answers.py bench/gpu/results/2026-12-07-smollm2-135m-gpu/restore \
        --tokenizer <run>/target/tokenizer.json --out cut_answers.json

The bundle's conversations (regenerated.jsonl.xz) do not record a finish reason, so an answer counts as cut when
its text re-encodes to at least the cap less `--slack` tokens (decoding and encoding again moves a count by a few
tokens; the bundle's stats give the regeneration's own count of cut answers to compare with). For each answer,
`repeated` is the share of its 8-word spans that already occurred earlier in the same answer: 0 for prose or code
that never repeats itself, near 1 for a greedy loop. Grouped by where the prompt came from (plain Magpie turns,
each steered family, the prompt files).
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))
from eagle3_workflow.prepare.repetition import repeated_share  # noqa: E402 (stdlib only)

LOOP_THRESHOLDS = (0.2, 0.5)


def origin_family(origin: str) -> str:
    """`magpie[python]:12` -> `magpie[python]`; `smollm2_prompts.txt:3` -> `smollm2_prompts.txt`."""
    return origin.rsplit(":", 1)[0]


def summarize(rows: Iterable[dict], count_tokens: Callable[[str], int], *, cap: int, slack: int) -> dict[str, object]:
    """Per origin family and in all: answers, those at the cap, and the repetition of cut and uncut answers."""
    groups: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        answer = row["conversations"][-1]["value"]
        kind = "cut" if count_tokens(answer) >= cap - slack else "finished"
        for family in (origin_family(row["origin"]), "all"):
            groups.setdefault(family, {"cut": [], "finished": []})[kind].append(repeated_share(answer))
    return {family: {kind: describe(shares) for kind, shares in kinds.items()} for family, kinds in groups.items()}


def describe(shares: list[float]) -> dict[str, object]:
    if not shares:
        return {"answers": 0}
    return {
        "answers": len(shares),
        "median_repeated": round(statistics.median(shares), 3),
        **{f"repeated_over_{t}": sum(s > t for s in shares) for t in LOOP_THRESHOLDS},
    }


def read_bundle(folder: Path) -> tuple[list[dict], dict]:
    with lzma.open(folder / "regenerated.jsonl.xz", "rt") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return rows, json.loads((folder / "regenerated.stats.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, help="a restore bundle (bench/gpu/restore_run.py pack)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the target's tokenizer.json")
    parser.add_argument("--slack", type=int, default=4, help="tokens below the cap that still count as cut")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    rows, stats = read_bundle(args.bundle)
    cap = int(stats["settings"]["max_tokens"])
    summary = {
        "bundle": str(args.bundle),
        "cap": cap,
        "slack": args.slack,
        "regeneration_counted_cut": stats.get("truncated_answers"),
        "by_origin": summarize(
            rows, lambda t: len(tokenizer.encode(t, add_special_tokens=False).ids), cap=cap, slack=args.slack
        ),  # fmt: skip
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
