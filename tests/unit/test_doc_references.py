"""Docs, docstrings and error texts name test files that exist (the suite moved to tests/{unit,integration,e2e}
once, and texts naming tests/test_*.py pointed nowhere)."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO

TEST_FILE = re.compile(r"\btests/[A-Za-z0-9_/]+\.py\b")


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [p for p in listed.splitlines() if p.endswith((".py", ".md", ".smk", ".yaml", ".sh")) or p == "Makefile"]


def test_every_test_file_named_exists():
    missing = sorted(
        f"{path}: {name}"
        for path in tracked_text_files()
        if (REPO / path).is_file()
        for name in set(TEST_FILE.findall((REPO / path).read_text(errors="ignore")))
        if not (REPO / name).exists()
    )
    assert missing == []
