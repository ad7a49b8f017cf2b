"""Reruns on the tiny preset (docs/reruns.md): what Snakemake reruns after a failure, a kill, a forced
retrain or a config change, and what it leaves alone.

- a replica that failed (fault injection: extraction.fail_after_samples) reruns alone, resuming from the
  samples already on disk; data preparation and the gates are not redone (the rerun goes up to validation: the
  stages after it are the tiny pipeline's, which test_e2e.py checks);
- `-R train_draft --until train_draft` retrains without re-extracting;
- a killed controller (and its jobs) recovers with `--unlock` then `--rerun-incomplete`;
- a changed train.* value reruns training and what follows it, nothing before (Snakemake 9's default rerun
  triggers include params; a rule's params carry the keys its stage's settings model declares, through
  stage_params in common.smk; tests/integration/test_rerun_planning.py checks every key).

What ran is read from the "Job stats" table Snakemake prints before it starts jobs.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import copied_run, kill_tree, run_workflow, start_workflow

pytestmark = pytest.mark.slow

PREPARE_AND_GATES = {"build_tiny_target", "prepare_data", "check_api", "canary"}
EXTRACTION = {"extract_hidden_states", "validate_hidden_states"}
# a config change reruns record_provenance by design (it records the whole resolved config)
AFTER_TRAINING = {
    "train_draft",
    "evaluate_draft",
    "package_draft",
    "summarize_run",
    "report",
    "record_provenance",
    "all",
}


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True, timeout: float = 1800):
    """Run the real workflow in `workdir` with targets and flags `args`."""
    return run_workflow(workdir, config, extra=list(args), check=check, timeout=timeout)


def planned_rules(proc: subprocess.CompletedProcess) -> set[str]:
    """Rules in the first "Job stats" table (the plan): what this invocation ran or, with -n, would run."""
    text = proc.stdout + proc.stderr
    match = re.search(r"Job stats:\njob\s+count\n[- ]+\n(.*?)\ntotal\s+\d+", text, re.DOTALL)
    if match is None:
        assert "Nothing to be done" in text, text[-4000:]
        return set()
    return {line.split()[0] for line in match.group(1).splitlines() if line.strip()}


def mtimes(paths: list[Path]) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in paths}


def hidden_state_files(run_dir: Path) -> dict[str, float]:
    return mtimes(sorted((run_dir / "hidden_states" / "files").glob("*.safetensors")))


def gate_artefacts(run_dir: Path) -> list[Path]:
    return [
        run_dir / "data" / "manifest.json",
        run_dir / "checks" / "api_compat.json",
        run_dir / "checks" / "canary.json",
    ]


def replica_manifest(run_dir: Path, replica: int = 0) -> dict:
    return json.loads((run_dir / "hidden_states" / f"replica_{replica}.json").read_text())


@pytest.fixture
def completed_run(tiny_pipeline, tmp_path):
    """A copy of the complete tiny run (conftest's tiny_pipeline, which tests/e2e/test_e2e.py checks), for the
    tests that rerun parts of it."""
    workdir, config, _ = tiny_pipeline
    return copied_run(workdir, tmp_path / "completed"), copy.deepcopy(config)


@pytest.fixture
def run_without_extraction(tiny_pipeline, tmp_path):
    """A copy of the complete tiny run less its hidden states: data and gates done, extraction to do again."""
    workdir, config, _ = tiny_pipeline
    hidden_states = Path("results") / config["run"] / "hidden_states"
    return copied_run(workdir, tmp_path / "completed", without=hidden_states), copy.deepcopy(config)


def test_failed_replica_reruns_alone_and_resumes(run_without_extraction):
    workdir, config = run_without_extraction
    run_dir = workdir / "results" / config["run"]
    # the first attempt stops after more than half of the samples, so that the second one, resuming, has fewer
    # than that left and finishes
    kept = json.loads((run_dir / "data" / "manifest.json").read_text())["records_kept"]
    fail_after = kept // 2 + 1
    config["extraction"]["fail_after_samples"] = fail_after

    first = snakemake(workdir, config, check=False)
    assert first.returncode != 0, "fault injection did not fail the run"
    assert "prepare_data" not in planned_rules(first)
    log = (run_dir / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "fault injection" in log, log[-3000:]
    assert not (run_dir / "hidden_states" / "replica_0.json").exists(), "a failed replica left its manifest"
    survived = hidden_state_files(run_dir)
    assert len(survived) >= fail_after, "sample files of the failed attempt were deleted"
    gates_before = mtimes(gate_artefacts(run_dir))

    # the same command again: nothing before extraction is planned
    plan = planned_rules(snakemake(workdir, config, "-n"))
    assert plan & PREPARE_AND_GATES == set(), plan
    assert "extract_hidden_states" in plan

    # the rerun up to validation: what follows it is the tiny pipeline's (tests/e2e/test_e2e.py)
    second = snakemake(workdir, config, f"results/{config['run']}/hidden_states/validation.json")
    assert planned_rules(second) == EXTRACTION, planned_rules(second)
    assert mtimes(gate_artefacts(run_dir)) == gates_before, "prepare/gate artefacts were rewritten"
    manifest = replica_manifest(run_dir)
    assert manifest["samples_reused"] >= len(survived) - 1, manifest  # one may have been mid-rename
    assert manifest["samples_reused"] + manifest["samples_extracted"] == manifest["samples_total"] == kept
    # files from the first attempt were reused, not rewritten
    after = hidden_state_files(run_dir)
    unchanged = [path for path, mtime in survived.items() if after.get(path) == mtime]
    assert len(unchanged) >= len(survived) - 1
    assert json.loads((run_dir / "hidden_states" / "validation.json").read_text())["passed"] is True


def test_changed_training_params_rerun_training_and_later_only(completed_run, tmp_path):
    workdir, config = completed_run
    changed = copy.deepcopy(config)
    changed["train"]["lr"] = config["train"]["lr"] / 2
    plan = planned_rules(snakemake(workdir, changed, "-n"))
    assert "train_draft" in plan, plan
    assert plan <= AFTER_TRAINING, f"a train.* change would also rerun {sorted(plan - AFTER_TRAINING)}"


def test_retrain_without_reextracting(completed_run):
    workdir, config = completed_run
    run_dir = workdir / "results" / config["run"]
    files_before = hidden_state_files(run_dir)
    upstream = gate_artefacts(run_dir) + [run_dir / "hidden_states" / "validation.json"]
    upstream_before = mtimes(upstream)
    draft_before = (run_dir / "draft").stat().st_mtime_ns

    proc = snakemake(workdir, config, "-R", "train_draft", "--until", "train_draft")
    assert planned_rules(proc) == {"train_draft"}, planned_rules(proc)
    assert hidden_state_files(run_dir) == files_before
    assert mtimes(upstream) == upstream_before
    assert (run_dir / "draft").stat().st_mtime_ns != draft_before
    # evaluation and report are now older than the draft: a plain run redoes exactly those
    plan = planned_rules(snakemake(workdir, config, "-n"))
    assert plan <= AFTER_TRAINING - {"train_draft", "record_provenance"}, plan
    assert "evaluate_draft" in plan, plan


def test_killed_controller_recovers_with_unlock_and_rerun_incomplete(run_without_extraction):
    workdir, config = run_without_extraction
    run_dir = workdir / "results" / config["run"]
    controller = start_workflow(workdir, config, workdir / "controller.log")
    try:
        # kill once extraction has written some samples (resume must then reuse them)
        deadline = time.monotonic() + 1200
        while len(hidden_state_files(run_dir)) < 8:
            assert controller.poll() is None, (workdir / "controller.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "extraction did not start in 20 min"
            time.sleep(0.5)
    finally:
        kill_tree(controller)
    written = len(hidden_state_files(run_dir))

    locked = snakemake(workdir, config, check=False)
    assert locked.returncode != 0
    assert "LockException" in locked.stderr or "cannot be locked" in locked.stderr, locked.stderr[-3000:]
    snakemake(workdir, config, "--unlock")
    # up to validation: what follows it is the tiny pipeline's (tests/e2e/test_e2e.py)
    validation = f"results/{config['run']}/hidden_states/validation.json"
    resumed = snakemake(workdir, config, validation, "--rerun-incomplete")
    assert planned_rules(resumed) == EXTRACTION, planned_rules(resumed)
    manifest = replica_manifest(run_dir)
    assert manifest["samples_reused"] >= written - 1, (manifest, written)
    assert json.loads((run_dir / "hidden_states" / "validation.json").read_text())["passed"] is True


def test_the_rule_retrains_with_two_cpu_ranks(completed_run):
    """train.cpu_processes through the real rule: the key reruns training only, and the job launches torchrun with
    two gloo ranks (tests/integration/test_training_ranks.py checks the ranks' stop, kill and failure paths)."""
    workdir, config = completed_run
    run_dir = workdir / "results" / config["run"]
    files_before = hidden_state_files(run_dir)
    config["train"]["cpu_processes"] = 2
    proc = snakemake(workdir, config, "--until", "train_draft")
    assert planned_rules(proc) == {"train_draft"}, planned_rules(proc)
    assert hidden_state_files(run_dir) == files_before
    summary = json.loads((run_dir / "draft" / "training.json").read_text())
    assert (summary["device"], summary["processes"], summary["attempts"]) == ("cpu", 2, 1), summary
    assert "torch.distributed.run" in " ".join(summary["command"]), summary["command"]
    assert (run_dir / "draft" / "metrics.csv").read_text().strip(), "no metrics from rank 0"
