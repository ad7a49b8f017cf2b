"""The last rules alone through Snakemake, on a finished run written without its stages (tests/synthetic_run.py
writes the files/*_artefacts.py models): package_draft publishes the draft with its model card, report makes a real
`snakemake --report` HTML. What they render, on their own: tests/unit/test_model_card.py, tests/unit/test_report.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import rules_run, run_workflow, synthetic_run_config
from synthetic_run import acceptance_report, write_synthetic_run

from eagle3_workflow.model_card.card import CARD_NAME


@pytest.fixture
def synthetic(tmp_path) -> tuple[Path, dict]:
    """A finished run "t" in tmp_path on a target folder there; returns the target and the run's config."""
    target = tmp_path / "target"
    target.mkdir()
    write_synthetic_run(tmp_path, "t", target=target, acceptance=acceptance_report())
    return target, synthetic_run_config(tmp_path, target)


def test_rule_package_draft_runs_after_evaluation(tmp_path, synthetic):
    target, config = synthetic
    draft_dir = tmp_path / "results" / "t" / "draft"
    staged_at = draft_dir.stat().st_mtime
    (draft_dir / ".snakemake_timestamp").touch()  # as train_draft's job leaves it, as old as the staged draft
    for path in (draft_dir / ".snakemake_timestamp", draft_dir):
        os.utime(path, (staged_at, staged_at))
    proc = run_workflow(tmp_path, config, targets=["results/t/published_draft"], extra=["--rerun-triggers=mtime"])
    assert rules_run(proc) == ["package_draft"]
    card = (tmp_path / "results" / "t" / "published_draft" / CARD_NAME).read_text()
    assert "| trained | **2.500** |" in card
    assert f"vllm serve {target}" in card
    # publishing leaves draft/ untouched: Snakemake's timestamp file, once hard-linked into the published copy,
    # was touched through it after package_draft, and every later run replanned evaluate_draft
    draft_stamp = tmp_path / "results" / "t" / "draft" / ".snakemake_timestamp"
    assert not (tmp_path / "results" / "t" / "published_draft" / ".snakemake_timestamp").samefile(draft_stamp)
    again = run_workflow(tmp_path, config, targets=["results/t/published_draft"], extra=["--rerun-triggers=mtime"])
    assert "Nothing to be done" in again.stdout + again.stderr


def test_rule_report_makes_a_snakemake_report_from_the_artefacts(tmp_path, synthetic):
    _, config = synthetic
    proc = run_workflow(tmp_path, config, targets=["results/t/report.html"], extra=["--rerun-triggers=mtime"])
    assert sorted(rules_run(proc)) == ["report", "summarize_run"]
    html = (tmp_path / "results" / "t" / "report.html").read_text()
    assert "Snakemake" in html
    assert len(html) > 500_000  # the self-contained Snakemake report
    for name in ("acceptance.svg", "training.svg", "summary.html", "provenance.html"):
        assert name in html, name
    assert (tmp_path / "results" / "t" / "logs" / "report.log").exists()
