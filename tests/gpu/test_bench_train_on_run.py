"""bench_gpu.py --train-on: the training pairs on a finished pipeline run's data and hidden-state files, so a lease
that ran the pipeline needs no extraction pass of the bench's own before the pairs (~340 s at the 8B shape). On the
tiny pipeline's run (conftest's, shared): the run's rows and files are what the runs get, every file validated
against its row; a run of another target, or one without hidden states, is refused with the fix. The trainer
processes are replaced by a recorder, as in test_bench_training_ledger.py: the real pairs take minutes even here."""

from __future__ import annotations

import argparse
import shutil

import pytest
from conftest import REPO, load_script

GPU = REPO / "bench" / "gpu"


def args_for(run, target, work, **changes) -> argparse.Namespace:
    values = {"samples": 128, "seq_len": 2048, "seed": 0, "train_epochs": 1, "total_seq_len": 256, "draft_vocab": 64,
              "device": "cpu", "target": target, "train_pairs": 1, "first_pair": 1, "skip_steps": 1, "train_on": run,
              "work": work}  # fmt: skip
    return argparse.Namespace(**(values | changes))


def test_the_pairs_train_on_the_runs_rows_and_files(tiny_pipeline, tmp_path, monkeypatch):
    bench = load_script(GPU / "bench_gpu.py")
    workdir, config, _ = tiny_pipeline
    run = workdir / "results" / config["run"]
    target = (run / "target").resolve()
    data_dir, files_dir, rows, tokens = bench.run_training_data(run, target)
    assert (data_dir, files_dir) == (run / "data", run / "hidden_states" / "files")
    assert rows > 0 and tokens > rows
    seen: list[tuple[str, str]] = []

    def recorder(ctx, tag):
        seen.append((tag, str(ctx["files_dir"])))
        return {"wall_s": 1.0, "steps": [{"step_ms": 10.0, "fwd_ms": 5.0}] * 4}

    monkeypatch.setattr(bench, "run_bare", recorder)
    monkeypatch.setattr(bench, "run_workflow", recorder)
    args = args_for(run, target, tmp_path)
    training = bench.bench_training(args, data_dir, files_dir, tmp_path, rows, data_tokens=tokens)
    assert [tag for tag, _ in seen] == ["warmup", "pair1-bare", "pair1-workflow"]
    assert {files for _, files in seen} == {str(files_dir)}
    assert training["data_tokens"] == tokens and "trained_tokens" not in training
    assert (tmp_path / "bare-data" / "hidden_states").resolve() == files_dir.resolve()
    assert "data tokens" in bench.training_lines(training)[0]
    # the ledger's key names the run: another run's finished runs are never taken for this one's
    key = bench.run_ledger_key(args, files_dir)
    assert key["train_on"] == str(run) and key != bench.run_ledger_key(args_for(None, target, tmp_path), files_dir)


def test_a_run_of_another_target_or_without_hidden_states_is_refused_with_the_fix(tiny_pipeline, tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    workdir, config, _ = tiny_pipeline
    run = workdir / "results" / config["run"]
    with pytest.raises(SystemExit, match="another model's. Fix: pass that run's target"):
        bench.run_training_data(run, tmp_path / "other-target")
    partial = tmp_path / "results" / "partial"
    shutil.copytree(run / "checks", partial / "checks")
    shutil.copytree(run / "data", partial / "data")
    with pytest.raises(SystemExit, match=r"hidden_states/files.*Fix: run the pipeline through validate_hidden_states"):
        bench.run_training_data(partial, tmp_path / "other-target")
