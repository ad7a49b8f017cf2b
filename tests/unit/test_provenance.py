"""Provenance records the workflow checkout's commit wherever the job runs, and the tree id of the files that ran."""

from __future__ import annotations

import os
import subprocess

from conftest import REPO

from eagle3_workflow.provenance.collect import git_state, working_tree_id


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


def git(repo, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_GLOBAL": "/dev/null", "PATH": os.environ["PATH"]}  # fmt: skip
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env).stdout


def checkout(tmp_path):
    """A small repository with a folder, an executable, a symlink and an ignored file, all committed."""
    repo = tmp_path / "repo"
    (repo / "workflow" / "rules").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "Snakefile").write_text("include: 'workflow/rules/a.smk'\n")
    (repo / "workflow" / "rules" / "a.smk").write_text("rule a:\n    shell: 'true'\n")
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "workflow-link").symlink_to("workflow")
    (repo / "a-b").write_text("sorts before the folder a/ in a tree, after it by plain name order\n")
    (repo / "a").mkdir()
    (repo / "a" / "x").write_text("x\n")
    (repo / ".gitignore").write_text("results/\n")
    (repo / "results").mkdir()
    (repo / "results" / "big.bin").write_bytes(b"\0" * 100)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def test_the_tree_id_of_a_clean_checkout_is_its_commits_tree(tmp_path):
    repo = checkout(tmp_path)
    assert working_tree_id(repo) == git(repo, "rev-parse", "HEAD^{tree}").strip()


def test_the_tree_id_names_the_files_on_disk_when_head_and_the_index_are_older_than_them(tmp_path):
    # what the lent GPU machine's copy is: .git from an earlier commit, the files of a later one
    repo = checkout(tmp_path)
    first = git(repo, "rev-parse", "HEAD^{tree}").strip()
    (repo / "workflow" / "rules" / "a.smk").write_text("rule a:\n    shell: 'echo changed'\n")
    (repo / "workflow" / "rules" / "b.smk").write_text("rule b:\n    shell: 'true'\n")  # new, untracked
    (repo / "a" / "x").unlink()  # deleted, still in the index
    on_disk = working_tree_id(repo)
    assert on_disk != first
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    assert on_disk == git(repo, "rev-parse", "HEAD^{tree}").strip()
    (repo / "run.sh").chmod(0o644)  # the executable bit is part of the tree
    assert working_tree_id(repo) != on_disk


def test_the_tree_id_says_unknown_outside_a_checkout(tmp_path):
    assert working_tree_id(tmp_path).startswith("unknown (")
