"""Provenance records the workflow checkout's commit wherever the job runs."""

from __future__ import annotations

import subprocess

from conftest import REPO

from eagle3_workflow.provenance.collect import git_state


def test_git_state_reads_the_workflow_checkout_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run directory outside any checkout (snakemake -d /scratch/run)
    expected = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    commit, _dirty = git_state(REPO)
    assert commit == expected.stdout.strip()
    assert len(commit) == 40


def test_git_state_says_which_folder_is_not_a_checkout(tmp_path):
    commit, dirty = git_state(tmp_path)
    assert commit.startswith("unknown")
    assert str(tmp_path) in commit
    assert dirty is False
