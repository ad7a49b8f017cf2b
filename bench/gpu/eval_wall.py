"""Where evaluate_draft's wall goes: each measurement process's import, engine start and generating, from the stage's
logs and its work folder (issue #42: "evaluation's wall against the sum of its engines' own generate time").

    python3 bench/gpu/eval_wall.py --log evaluate_draft-attempt1.log [--log ...] --work <run>/eval/work --out eval_wall.json

--log once per attempt, in order (a cut attempt's log ends without `stage evaluate_draft: done`). From the logs: the
stage's window, each measurement process's start (`the measurement process (<label>): ... measure_N.spec.json`), its
`import vllm` seconds and its wall (`measurement process measure_N done in X s`). From the work folder: each
process's spec (its runs' result files) and those results (`engine_start_s`, the lossless pass's `generate_s`, the
timing passes' seconds). What is left of a process's wall is process start, prompts, the timing passes' warm-up and
engine shutdown; what is left of the stage's wall outside its processes is setup (the untrained baseline's build)
and the judging after them.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ ")
PROCESS = re.compile(r"the measurement process \((\w+)\)(?:, started before its spec)?: .*?(measure_\d+)\.spec\.json")
STOPPED = re.compile(r"(measure_\d+), started early, is not the process to run first")
IMPORTED = re.compile(r"vllm \S+ imported in ([\d.]+) s \((\w+) kernels\)")
DONE = re.compile(r"measurement process (measure_\d+) done in ([\d.]+) s")


def _time(line: str) -> datetime | None:
    found = STAMP.match(line)
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S") if found else None


def parse_attempt(text: str) -> dict[str, Any]:
    """One attempt's log: its window, and each measurement process it started (the one started ahead of its spec
    and stopped is not counted: it never measured). A process the attempt's cut killed has no wall: `cut_s` is from
    its start to the log's last line."""
    processes: list[dict[str, Any]] = []
    first = last = None
    for line in text.splitlines():
        last = _time(line) or last
        first = first or last
        if found := PROCESS.search(line):
            processes.append({"process": found.group(2), "label": found.group(1), "import_s": None, "wall_s": None,
                              "started": last})  # fmt: skip
        elif (found := IMPORTED.search(line)) and processes and processes[-1]["import_s"] is None:
            processes[-1]["import_s"] = float(found.group(1))
            processes[-1]["kernels"] = found.group(2)
        elif (found := STOPPED.search(line)) and processes and processes[-1]["process"] == found.group(1):
            started = processes[-1].pop("started")
            processes[-1]["stopped_s"] = (last - started).total_seconds() if started and last else 0.0
        elif found := DONE.search(line):
            for p in processes:
                if p["process"] == found.group(1):
                    p["wall_s"] = float(found.group(2))
    for p in processes:
        started = p.pop("started", None)
        if p["wall_s"] is None and started and last:
            p["cut_s"] = (last - started).total_seconds()
    wall = (last - first).total_seconds() if first and last else 0.0
    return {"wall_s": wall, "finished": "stage evaluate_draft: done" in text, "processes": processes}


def result_names(process: dict[str, Any], specs: dict[str, dict]) -> list[str]:
    """The result files a process wrote: its spec's, or (a spec the next attempt replaced) the one its label and
    kernels name: production kernels time, batch-invariant ones judge losslessness."""
    if process["process"] in specs:
        return [Path(run["result_path"]).name for run in specs[process["process"]]["runs"]]
    kind = "lossless" if process.get("kernels") == "batch_invariant" else "timing"
    return [f"{process['label']}.{kind}.json"]


def process_costs(names: list[str], results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """A process's engine starts and generating seconds, summed over its runs' results."""
    engine = generate = 0.0
    for name in names:
        result = results.get(name, {})
        engine += result.get("engine_start_s", 0.0)
        generate += result.get("generate_s", 0.0)
        generate += sum(sum(t.get("seconds_passes", [t["seconds"]])) for t in result.get("timings", []))
    return {"engine_start_s": engine, "generate_s": generate}


def breakdown(attempts: list[dict[str, Any]], specs: dict[str, dict], results: dict[str, dict]) -> dict[str, Any]:
    """Per process and in all: import, engine start, generating and the rest, over every attempt."""
    rows = []
    for number, attempt in enumerate(attempts, 1):
        for p in attempt["processes"]:
            row = {"attempt": number, **p}
            if p["wall_s"] is not None:
                row.update(process_costs(result_names(p, specs), results))
                row["rest_s"] = p["wall_s"] - (p["import_s"] or 0.0) - row["engine_start_s"] - row["generate_s"]
            rows.append(row)
    done = [r for r in rows if "rest_s" in r]
    stage = sum(a["wall_s"] for a in attempts)
    parts = {
        "import_s": sum(r["import_s"] or 0.0 for r in done),
        "engine_start_s": sum(r["engine_start_s"] for r in done),
        "generate_s": sum(r["generate_s"] for r in done),
        "process_rest_s": sum(r["rest_s"] for r in done),
        "cut_processes_s": sum(r.get("cut_s", 0.0) for r in rows),
        "stopped_early_s": sum(r.get("stopped_s", 0.0) for r in rows),
    }
    parts["outside_processes_s"] = (
        stage - sum(r["wall_s"] for r in done) - parts["cut_processes_s"] - parts["stopped_early_s"]
    )
    shares = {k: round(v / stage, 3) if stage else None for k, v in parts.items()}
    return {"stage_wall_s": stage, "attempts": len(attempts), "parts": parts, "shares": shares, "processes": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", type=Path, action="append", required=True, help="one per attempt, in order")
    parser.add_argument("--work", type=Path, required=True, help="the run's eval/work folder")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    attempts = [parse_attempt(log.read_text()) for log in args.log]
    specs = {
        p.name.removesuffix(".spec.json"): json.loads(p.read_text()) for p in args.work.glob("measure_*.spec.json")
    }
    results = {p.name: json.loads(p.read_text()) for p in (args.work / "runs").glob("*.json") if ".key." not in p.name}
    out = breakdown(attempts, specs, results)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for r in out["processes"]:
        print(f"attempt {r['attempt']} {r['process']} {r['label']:15s} wall {r['wall_s']!s:>6} import {r['import_s']!s:>5}"
              f" engine {r.get('engine_start_s', '-')!s:>.6} generate {r.get('generate_s', '-')!s:>.6}")  # fmt: skip
    print(json.dumps({"stage_wall_s": out["stage_wall_s"], "parts": out["parts"], "shares": out["shares"]}, indent=1))


if __name__ == "__main__":
    main()
