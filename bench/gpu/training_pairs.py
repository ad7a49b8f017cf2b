"""The training pairs of bench_gpu.py from its run ledger, for a lease that ended before the bench wrote its JSON
(each device call is cut at 10 minutes; the ledger, --work/training-runs.jsonl, keeps every finished run).

    python3 bench/gpu/training_pairs.py training-runs.jsonl[.gz] [--skip-steps 5] --out training_pairs.json

The complete pairs are compared as bench_gpu.py compares them (steady steps/s per side, each pair's ratio, the
verdict against the goal, which needs 3 pairs, and the per-phase medians); a run whose partner never ran is listed
under "unpaired" and left out. Every run in the ledger must share one key (data, files, flags): runs of different
settings are not one comparison.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import training_result  # noqa: E402


def read_ledger(path: Path) -> tuple[dict, list[dict]]:
    """The ledger's one key and its runs in the order they finished; an error naming the keys when there are
    several."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    keys = {json.dumps(r["key"], sort_keys=True) for r in records}
    if len(keys) != 1:
        raise SystemExit(f"{path}: {len(keys)} keys, one comparison needs one: {sorted(keys)}")
    return records[0]["key"], [r["run"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ledger", type=Path)
    parser.add_argument("--skip-steps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    key, runs = read_ledger(args.ledger)
    result = {"key": key, "skip_steps": args.skip_steps} | training_result(runs, args.skip_steps)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    c = result["comparison"]
    print(f"pairs {c['pair_ratios']}  ratio of medians {c['ratio_of_medians']}  {c['verdict']}")
    print(f"unpaired: {result['unpaired']}")


if __name__ == "__main__":
    main()
