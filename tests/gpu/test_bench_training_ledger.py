"""bench_gpu.py's training ledger: the fair pairs (a warm-up and three pairs, ~100 s a run at the 8B shape) outlast
one 10-minute device call, so each finished run is recorded and a later call goes on from there. No GPU: the
runners are replaced by a recorder of what would have run (the plan and the ledger are the code under test)."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import REPO, load_script

GPU = REPO / "bench" / "gpu"


def bench_args(tmp_path, **changes) -> argparse.Namespace:
    values = {"samples": 8, "seq_len": 64, "seed": 0, "train_epochs": 1, "total_seq_len": 256, "draft_vocab": 2048,
              "device": "cpu", "target": tmp_path / "target", "train_pairs": 3}  # fmt: skip
    return argparse.Namespace(**(values | changes))


def test_a_finished_run_is_kept_under_the_same_key_and_never_under_another(tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    ledger, files = tmp_path / "training-runs.jsonl", tmp_path / "workflow-files-2"
    key = bench.run_ledger_key(bench_args(tmp_path), files)
    assert bench.finished_runs(ledger, key) == {}
    bench.record_run(ledger, key, {"tag": "warmup", "side": "bare", "step_ms": [1.0, 2.0]})
    bench.record_run(ledger, key, {"tag": "pair1-bare", "side": "bare", "step_ms": [3.0]})
    assert set(bench.finished_runs(ledger, key)) == {"warmup", "pair1-bare"}
    assert bench.finished_runs(ledger, key)["pair1-bare"]["step_ms"] == [3.0]
    # other data, other flags or other files: nothing is reused
    for other in (
        bench.run_ledger_key(bench_args(tmp_path, samples=16), files),
        bench.run_ledger_key(bench_args(tmp_path, train_epochs=2), files),
        bench.run_ledger_key(bench_args(tmp_path), tmp_path / "workflow-files-1"),
    ):
        assert bench.finished_runs(ledger, other) == {}


def test_a_line_torn_by_a_cut_call_is_skipped_and_that_run_redone(tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    ledger = tmp_path / "training-runs.jsonl"
    key = bench.run_ledger_key(bench_args(tmp_path), tmp_path / "files")
    bench.record_run(ledger, key, {"tag": "warmup", "side": "bare", "step_ms": [1.0]})
    with ledger.open("a") as out:
        out.write(json.dumps({"key": key, "run": {"tag": "pair1-bare"}})[:25])
    assert set(bench.finished_runs(ledger, key)) == {"warmup"}


def test_a_second_call_runs_only_what_the_first_left(tmp_path, monkeypatch):
    bench = load_script(GPU / "bench_gpu.py")
    args = bench_args(tmp_path, train_pairs=2)
    ran: list[str] = []

    def runner(cut_after: int | None):
        def run(ctx, tag):
            if cut_after is not None and len(ran) == cut_after:
                raise KeyboardInterrupt  # the device call's timeout
            ran.append(tag)
            return {"wall_s": 1.0, "steps": [{"step_ms": 10.0 + i} for i in range(6)]}

        return run

    def one_call(cut_after):
        monkeypatch.setattr(bench, "run_bare", runner(cut_after))
        monkeypatch.setattr(bench, "run_workflow", runner(cut_after))
        return bench.training_runs({"work": tmp_path}, args, tmp_path / "files")

    try:
        one_call(cut_after=2)
    except KeyboardInterrupt:
        pass
    assert ran == ["warmup", "pair1-bare"]
    runs = one_call(cut_after=None)
    assert ran == ["warmup", "pair1-bare", "pair1-workflow", "pair2-workflow", "pair2-bare"]
    assert [r["tag"] for r in runs] == ["warmup", "pair1-bare", "pair1-workflow", "pair2-workflow", "pair2-bare"]
    assert all(len(r["step_ms"]) == 6 for r in runs)


def steps(ms: float) -> dict:
    return {"step_ms": [ms] * 8, "steps": [{"step_ms": ms, "fwd_ms": ms / 2}] * 8, "wall_s": 100.0}


def test_a_pair_missing_a_side_is_named_and_left_out_of_the_comparison(tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    plan = bench.run_plan(3)
    ms = {"bare": 150.0, "workflow": 140.0}
    runs = [item | steps(ms[item["side"]]) for item in plan[:-1]]  # the lease ended before pair3-workflow
    paired, unpaired = bench.complete_pairs(runs)
    assert [r["tag"] for r in unpaired] == ["pair3-bare"]
    assert {r["pair"] for r in paired} == {1, 2}
    result = bench.training_result(runs, skip=2)
    assert result["unpaired"] == ["pair3-bare"]
    assert result["comparison"]["pair_ratios"] == [round(150 / 140, 4)] * 2
    assert result["comparison"]["verdict"].startswith("no verdict: 2 pair(s)")
    assert [r["tag"] for r in result["per_run"]] == [r["tag"] for r in runs]
    with pytest.raises(ValueError, match="no complete pair"):
        bench.training_result(runs[:2], skip=2)  # the warm-up and pair1-bare
    # with the last run the verdict follows from three pairs
    whole = bench.training_result(runs + [plan[-1] | steps(140.0)], skip=2)
    assert whole["unpaired"] == [] and whole["comparison"]["verdict"] == "meets the goal"


def test_the_pairs_script_reads_a_gzipped_ledger_and_refuses_mixed_keys(tmp_path):
    import gzip
    import subprocess
    import sys

    bench = load_script(GPU / "bench_gpu.py")
    key = bench.run_ledger_key(bench_args(tmp_path), tmp_path / "files")
    plan = bench.run_plan(3)
    lines = [json.dumps({"key": key, "run": item | steps(150.0 if item["side"] == "bare" else 160.0)}) for item in plan]
    ledger = tmp_path / "training-runs.jsonl.gz"
    ledger.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    out = tmp_path / "pairs.json"
    script = [sys.executable, str(GPU / "training_pairs.py")]
    done = subprocess.run(
        [*script, str(ledger), "--skip-steps", "2", "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (
        result["key"] == json.loads(json.dumps(key))
        and result["comparison"]["pair_ratios"] == [round(150 / 160, 4)] * 3
    )
    assert result["comparison"]["verdict"] == "below the goal"
    other = bench.run_ledger_key(bench_args(tmp_path, samples=16), tmp_path / "files")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(lines[0] + "\n" + json.dumps({"key": other, "run": plan[1] | steps(1.0)}) + "\n")
    refused = subprocess.run([*script, str(mixed), "--out", str(out)], capture_output=True, text=True)
    assert refused.returncode != 0 and "2 keys" in refused.stderr
