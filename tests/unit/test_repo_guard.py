"""tests/repo_guard.py for real: a scratch git checkout, pytest run on it with the guard, and tests that touch its
shipped data (an mtime only, as tests/synthetic_run.py once did to config/data/) or its bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import TESTS

TOUCHES = """
import os, time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "config" / "data" / "conversations.jsonl"


def test_reads_only():
    assert DATA.read_text()


def test_ages_shipped_data():
    old = time.time() - 1010
    os.utime(DATA, (old, old))


def test_reads_only_afterwards():
    assert DATA.read_text()
"""

EDITS = """
import os
from pathlib import Path


def test_rewrites_shipped_data_keeping_its_mtime():
    data = Path(__file__).resolve().parent / "config" / "data" / "conversations.jsonl"
    info = data.stat()
    data.write_text(data.read_text().upper())  # same size
    os.utime(data, ns=(info.st_atime_ns, info.st_mtime_ns))
"""


def scratch_checkout(root: Path, test_source: str) -> Path:
    """A git repository with a shipped data file and one test module, committed."""
    (root / "config" / "data").mkdir(parents=True)
    (root / "config" / "data" / "conversations.jsonl").write_text('{"conversations": []}\n')
    (root / "test_scratch.py").write_text(test_source)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p repo_guard\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "scratch"], check=True)
    return root


def run_pytest(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root)], cwd=root,
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


def test_a_test_that_ages_shipped_data_fails_named(tmp_path):
    root = scratch_checkout(tmp_path / "repo", TOUCHES)
    proc = run_pytest(root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert "ERROR at teardown of test_ages_shipped_data" in out, out
    assert "config/data/conversations.jsonl: mtime moved by -10" in out, out  # -1010 s, to the second
    assert "copy what it needs to age or change into its tmp_path" in out, out
    # reported once: the next test, which touches nothing, passes
    assert "test_reads_only_afterwards" not in out.split("short test summary")[-1], out


def test_a_session_that_rewrites_shipped_bytes_fails_even_with_the_mtime_restored(tmp_path):
    root = scratch_checkout(tmp_path / "repo", EDITS)
    proc = run_pytest(root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "repository changed" in out and "config/data/conversations.jsonl" in out, out


def test_a_session_that_touches_nothing_passes(tmp_path):
    root = scratch_checkout(tmp_path / "repo", "def test_nothing():\n    assert True\n")
    proc = run_pytest(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
