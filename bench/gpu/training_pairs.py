"""The training pairs of bench_gpu.py from its run ledgers, for a lease that ended before the bench wrote its JSON
(each device call is cut at 10 minutes; the ledger, --work/training-runs.jsonl, keeps every finished run), and for
pairs that several leases measured (a lease's device time rarely holds the warm-up and all three pairs).

    python3 bench/gpu/training_pairs.py LEDGER[.gz] [LEDGER[.gz] ...] [--skip-steps 5] --out training_pairs.json

The complete pairs are compared as bench_gpu.py compares them (steady steps/s per side, each pair's ratio, the
verdict against the goal, which needs 3 pairs, and the per-phase medians); a run whose partner never ran is listed
under "unpaired" and left out. Every run of every ledger must share one key (data, files, flags): runs of different
settings are not one comparison. A pair is the two runs of one ledger, back to back on one machine, so a pair never
spans two leases; with several ledgers each run is named `<ledger>:<tag>`, and pair numbers that two ledgers both
completed are refused (the later lease's bench takes `--first-pair` after the earlier one's pairs).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import PATH_FLAGS, complete_pairs, flag_values, training_result  # noqa: E402


def read_ledger(path: Path) -> tuple[dict, list[dict]]:
    """The ledger's one key and its runs in the order they finished; an error naming the keys when there are
    several."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        raise SystemExit(f"{path}: no finished run")
    keys = {json.dumps(r["key"], sort_keys=True) for r in records}
    if len(keys) != 1:
        raise SystemExit(f"{path}: {len(keys)} keys, one comparison needs one: {sorted(keys)}")
    return records[0]["key"], [r["run"] for r in records]


def ledger_label(path: Path) -> str:
    """A ledger's name in the runs' tags: its folder (a lease's results folder) when its file names repeat."""
    return path.parent.name or path.name


def combine_ledgers(ledgers: list[tuple[str, dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """(label, key, runs) per ledger -> the one key and every run, each pair kept inside its own ledger. One ledger:
    its runs as they are. Several: the keys must be equal; each run is tagged `<label>:<tag>` and keeps its pair
    number, which must not be a complete pair of two ledgers (then the pairs' numbers say which lease ran which)."""
    keys = {json.dumps(key, sort_keys=True) for _, key, _ in ledgers}
    if len(keys) != 1:
        named = {label: key for label, key, _ in ledgers}
        raise SystemExit(f"the ledgers hold {len(keys)} keys; pairs of other settings are not one comparison: {named}")
    if len(ledgers) == 1:
        return ledgers[0][1], ledgers[0][2]
    flags = {(side, json.dumps(f, sort_keys=True)) for _, _, runs in ledgers for side, f in trainer_flags(runs).items()}
    if len(flags) != len({side for side, _ in flags}):
        named = {label: trainer_flags(runs) for label, _, runs in ledgers}
        raise SystemExit(f"the ledgers' trainers ran with other flags (paths aside), not one comparison: {named}")
    owner: dict[int, str] = {}
    runs: list[dict] = []
    for label, _, ledger_runs in ledgers:
        whole = {run["pair"] for run in complete_pairs(ledger_runs)[0]}
        for pair in sorted(whole):
            if pair in owner:
                raise SystemExit(
                    f"pair {pair} is complete in both {owner[pair]} and {label}: give the later lease's bench "
                    "--first-pair after the earlier lease's last pair"
                )
            owner[pair] = label
        for run in ledger_runs:
            # a run whose partner is in no ledger gets a pair number of its own ledger, so it stays unpaired
            pair = run["pair"] if run["pair"] is None or run["pair"] in whole else f"{label}:{run['pair']}"
            runs.append(run | {"tag": f"{label}:{run['tag']}", "pair": pair, "ledger": label})
    return ledgers[0][1], runs


def trainer_flags(runs: list[dict]) -> dict[str, dict]:
    """Per side, the flags its trainer processes ran with, paths aside (bench_gpu.PATH_FLAGS: each run's own
    folders); an error when two runs of one side differ, since then one ledger is not one setting."""
    seen: dict[str, dict] = {}
    for run in runs:
        flags = {flag: values for flag, values in flag_values(run["command"]).items() if flag not in PATH_FLAGS}
        if seen.setdefault(run["side"], flags) != flags:
            raise SystemExit(f"{run['tag']}: flags {flags} differ from its side's earlier runs' {seen[run['side']]}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ledgers", type=Path, nargs="+")
    parser.add_argument("--skip-steps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    labels = [ledger_label(path) for path in args.ledgers]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"two ledgers in one folder: {[str(p) for p in args.ledgers]}; one ledger per lease folder")
    key, runs = combine_ledgers([(label, *read_ledger(path)) for label, path in zip(labels, args.ledgers, strict=True)])
    result = {"key": key, "skip_steps": args.skip_steps} | training_result(runs, args.skip_steps)
    if len(labels) > 1:
        paired = complete_pairs(runs)[0]
        result["pairs_by_ledger"] = {
            label: sorted({r["pair"] for r in paired if r["ledger"] == label}) for label in labels
        }
        result["machines"] = sorted({f"{r['ledger']}: {r.get('gpu') or 'not recorded'}" for r in runs})
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    c = result["comparison"]
    print(f"pairs {c['pair_ratios']}  ratio of medians {c['ratio_of_medians']}  {c['verdict']}")
    print(f"unpaired: {result['unpaired']}")


if __name__ == "__main__":
    main()
