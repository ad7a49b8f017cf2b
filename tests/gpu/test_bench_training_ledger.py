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
              "device": "cpu", "target": tmp_path / "target", "train_pairs": 3, "first_pair": 1}  # fmt: skip
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


def test_a_later_lease_numbers_its_pairs_after_the_earlier_ones_and_keeps_the_order_alternating():
    bench = load_script(GPU / "bench_gpu.py")
    plan = bench.run_plan(2, first_pair=3)
    assert [r["tag"] for r in plan] == ["warmup", "pair3-bare", "pair3-workflow", "pair4-workflow", "pair4-bare"]
    assert bench.run_plan(1)[1:] == [r | {"pair": 1, "tag": r["tag"].replace("3", "1")} for r in plan[1:3]]
    with pytest.raises(ValueError, match="--first-pair must be >= 1"):
        bench.run_plan(1, first_pair=0)


def test_a_run_records_the_machine_it_ran_on_and_the_first_pair_is_honoured(tmp_path, monkeypatch):
    bench = load_script(GPU / "bench_gpu.py")
    args = bench_args(tmp_path, train_pairs=1, first_pair=3)

    def run(ctx, tag):
        return {"wall_s": 1.0, "steps": [{"step_ms": 10.0}] * 4}

    monkeypatch.setattr(bench, "run_bare", run)
    monkeypatch.setattr(bench, "run_workflow", run)
    monkeypatch.setattr(bench, "gpu_name", lambda: "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04")
    runs = bench.training_runs({"work": tmp_path}, args, tmp_path / "files")
    assert [r["tag"] for r in runs] == ["warmup", "pair3-bare", "pair3-workflow"]
    assert {r["gpu"] for r in runs} == {"NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"}
    assert all(r["host"] for r in runs)


def ledger_lines(key: dict, items: list[dict], ms: dict[str, float], flags: tuple[str, ...] = ("--lr", "3e-4")) -> str:
    lines = []
    for item in items:
        command = ["python", "-m", "entry", "--save-path", f"/w/{item['tag']}", *flags]
        lines.append(json.dumps({"key": key, "run": item | steps(ms[item["side"]]) | {"command": command}}))
    return "\n".join(lines) + "\n"


def run_pairs_script(*ledgers, out):
    import subprocess
    import sys

    command = [
        sys.executable,
        str(GPU / "training_pairs.py"),
        *map(str, ledgers),
        "--skip-steps",
        "2",
        "--out",
        str(out),
    ]
    return subprocess.run(command, capture_output=True, text=True)


def test_pairs_of_one_key_from_two_leases_give_the_verdict_together(tmp_path):
    """The 2026-12-07 lease finished pairs 1 and 2 and the bare run of pair 3; a later lease (its own warm-up,
    --first-pair 3) finishes pair 3: three pairs, each inside one lease, and the verdict."""
    import gzip

    bench = load_script(GPU / "bench_gpu.py")
    key = bench.run_ledger_key(bench_args(tmp_path), tmp_path / "workflow-files-2")
    (tmp_path / "lease-a").mkdir()
    (tmp_path / "lease-b").mkdir()
    earlier = tmp_path / "lease-a" / "training-runs.jsonl.gz"
    earlier.write_bytes(
        gzip.compress(ledger_lines(key, bench.run_plan(3)[:-1], {"bare": 150.0, "workflow": 140.0}).encode())
    )
    later = tmp_path / "lease-b" / "training-runs.jsonl"
    later.write_text(ledger_lines(key, bench.run_plan(1, first_pair=3), {"bare": 160.0, "workflow": 150.0}))
    out = tmp_path / "pairs.json"
    done = run_pairs_script(earlier, later, out=out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["comparison"]["pair_ratios"] == [round(150 / 140, 4)] * 2 + [round(160 / 150, 4)]
    assert result["comparison"]["verdict"] == "meets the goal"
    # the earlier lease's pair3-bare never met the later lease's pair3-workflow: it stays unpaired
    assert result["unpaired"] == ["lease-a:pair3-bare"]
    assert result["pairs_by_ledger"] == {"lease-a": [1, 2], "lease-b": [3]}
    assert result["machines"] == ["lease-a: not recorded", "lease-b: not recorded"]
    # each ledger alone: no verdict from either
    alone = run_pairs_script(later, out=tmp_path / "alone.json")
    assert alone.returncode == 0 and "no verdict: 1 pair(s)" in alone.stdout


def test_ledgers_of_other_settings_or_with_one_pair_number_twice_are_refused(tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    key = bench.run_ledger_key(bench_args(tmp_path), tmp_path / "files")
    ms = {"bare": 150.0, "workflow": 140.0}

    def ledger(name: str, text: str):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "training-runs.jsonl"
        path.write_text(text)
        return path

    first = ledger("a", ledger_lines(key, bench.run_plan(2), ms))
    again = ledger("b", ledger_lines(key, bench.run_plan(1, first_pair=2), ms))
    other_key = ledger("c", ledger_lines(bench.run_ledger_key(bench_args(tmp_path, samples=16), tmp_path / "files"),
                                         bench.run_plan(1, first_pair=3), ms))  # fmt: skip
    other_flags = ledger("d", ledger_lines(key, bench.run_plan(1, first_pair=3), ms, flags=("--lr", "1e-3")))
    out = tmp_path / "pairs.json"
    twice = run_pairs_script(first, again, out=out)
    assert (
        twice.returncode != 0
        and "pair 2 is complete in both a and b" in twice.stderr
        and "--first-pair" in twice.stderr
    )
    keys = run_pairs_script(first, other_key, out=out)
    assert keys.returncode != 0 and "2 keys" in keys.stderr
    flags = run_pairs_script(first, other_flags, out=out)
    assert flags.returncode != 0 and "other flags" in flags.stderr
    assert not out.exists()
