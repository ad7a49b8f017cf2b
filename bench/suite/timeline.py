"""Where `make test`'s wall time goes: read the timeline that EAGLE3_TEST_TIMELINE=<file> makes the suite write
(tests/conftest.py) and print each worker's busy time, idle time and last test, the tests that used the most CPU,
and those that ended last.

    EAGLE3_TEST_TIMELINE=/tmp/timeline.jsonl make test
    python bench/suite/timeline.py /tmp/timeline.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read_tests(path: Path) -> list[dict]:
    """One record per test (worker, test, start, stop, cpu, snakemake_runs/dry_runs/jobs/seconds), in the order they
    started."""
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda t: t["start"])


def row(test: dict, origin: float) -> str:
    """One test: wall and CPU seconds, worker, start-stop in seconds from `origin`, id."""
    return (f"  {test['stop'] - test['start']:7.1f} s {test['cpu']:7.1f} cpu  {test['worker']}  "
            f"{test['start'] - origin:5.0f}-{test['stop'] - origin:5.0f}  {test['test']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    tests = read_tests(args.timeline)
    origin = min(t["start"] for t in tests)
    end = max(t["stop"] for t in tests)
    cpu = sum(t["cpu"] for t in tests)
    print(f"{len(tests)} tests, {end - origin:.0f} s from the first start to the last stop, {cpu:.0f} CPU-seconds "
          f"in tests ({cpu / (end - origin):.2f} cores busy on average)")  # fmt: skip
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for test in tests:
        by_worker[test["worker"]].append(test)
    for worker, own in sorted(by_worker.items()):
        busy = sum(t["stop"] - t["start"] for t in own)
        last = own[-1]
        print(f"{worker}: {len(own)} tests, busy {busy:.0f} s, idle {end - origin - busy:.0f} s, done at "
              f"{last['stop'] - origin:.0f} s; last: {last['test']} ({last['start'] - origin:.0f}-"
              f"{last['stop'] - origin:.0f} s)")  # fmt: skip
    snakemake = {k: sum(t.get(f"snakemake_{k}", 0) for t in tests) for k in ("runs", "dry_runs", "jobs", "seconds")}
    print(f"Snakemake: {snakemake['runs']:.0f} command lines (run_workflow/start_workflow), {snakemake['dry_runs']:.0f} "
          f"of them dry runs; {snakemake['jobs']:.0f} jobs run by those that the test waited for, "
          f"{snakemake['seconds']:.0f} s in them")  # fmt: skip
    print(f"\nmost CPU, top {args.top} (wall, CPU, start-stop in seconds from the first start):")
    for test in sorted(tests, key=lambda t: -t["cpu"])[: args.top]:
        print(row(test, origin))
    print("\nthe last 10 to finish:")
    for test in sorted(tests, key=lambda t: t["stop"])[-10:]:
        print(row(test, origin))


if __name__ == "__main__":
    main()
