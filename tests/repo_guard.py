"""The suite never changes the repository: not a tracked file's bytes, not even its mtime.

A test that ages or edits a shipped file (config/data/, a preset) makes every later run in the same clone replan
from that file: on a slow day the rerun tests found every rule from build_tiny_target on replanned, because a
helper had set the mtime of config/data/* to "now - 1010 s" (issue 29). What a test needs to age or change, it
copies into its own tmp_path.

`RepoGuard` watches the tracked files (`git ls-files`) of one checkout:
- after every test, the (mtime, size) of each tracked file against the session's start: a change fails that test
  at teardown, naming the files (under xdist the culprit may be a test running beside it on another worker: the
  message says how to confirm);
- at the session's end, the bytes of every tracked file (sha256) against its start: a change fails the session.
It is a pytest plugin (`-p repo_guard` in pyproject.toml's addopts) guarding the checkout at pytest's rootdir;
tests/unit/test_repo_guard.py runs it on a scratch git repository.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

Stat = tuple[int, int] | None  # (st_mtime_ns, st_size); None = the file is gone


def tracked_files(repo: Path) -> list[str]:
    """The checkout's tracked files, relative to `repo` (git ls-files); git's refusal is raised with its message."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, text=True, check=False)
    if listed.returncode != 0:
        raise RuntimeError(f"git ls-files in {repo} failed ({listed.stderr.strip()!r}): the guard needs a git checkout")
    return [name for name in listed.stdout.split("\0") if name]


def stat_of(path: Path) -> Stat:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_mtime_ns, info.st_size


def digest_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """The names whose recorded value changed (a file gone is a change too), sorted."""
    return sorted(name for name in before if after.get(name) != before[name])


def describe(name: str, before: Stat, after: Stat) -> str:
    if after is None:
        return f"{name}: deleted"
    if before is None:
        return f"{name}: created"
    parts = []
    if after[1] != before[1]:
        parts.append(f"size {before[1]} -> {after[1]} bytes")
    if after[0] != before[0]:
        parts.append(f"mtime moved by {(after[0] - before[0]) / 1e9:+.0f} s")
    return f"{name}: {', '.join(parts)}"


class RepoGuard:
    """The tracked files of `repo` as the session found them, checked after each test and at the end."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.names = tracked_files(repo)
        self.stats = self._stats()
        self.digests = self._digests()

    def _stats(self) -> dict[str, Stat]:
        return {name: stat_of(self.repo / name) for name in self.names}

    def _digests(self) -> dict[str, str | None]:
        return {name: digest_of(self.repo / name) for name in self.names}

    def changed_files(self) -> list[str]:
        """Files whose mtime or size moved since the last check (each is reported once: the baseline follows)."""
        now = self._stats()
        changed = [describe(name, self.stats[name], now[name]) for name in differences(self.stats, now)]
        self.stats = now
        return changed

    def changed_contents(self) -> list[str]:
        """Tracked files whose bytes differ from the session's start."""
        return differences(self.digests, self._digests())

    def fixture(self) -> Iterator[None]:
        """The body of an autouse fixture: the test runs, then any tracked file it moved fails it."""
        yield
        changed = self.changed_files()
        if changed:
            worker = os.environ.get("PYTEST_XDIST_WORKER")
            beside = (
                f" Under pytest-xdist ({worker}) a test running beside it on another worker may be the cause: run "
                "this test alone (-p no:xdist) to confirm."
                if worker
                else ""
            )
            pytest.fail(
                f"this test changed the repository's tracked files: {'; '.join(changed)}. A test must never write "
                f"into the repository tree, not even an mtime: copy what it needs to age or change into its "
                f"tmp_path.{beside}",
                pytrace=False,
            )

    def session_finished(self, session: pytest.Session) -> None:
        """At the end: any tracked file whose bytes changed fails the session, named."""
        changed = self.changed_contents()
        if not changed:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"the test session changed the bytes of tracked files of {self.repo}: {', '.join(changed)} "
            "(git diff shows how); a test must copy what it changes into its tmp_path"
        )
        if reporter is not None:
            reporter.write_sep("=", "repository changed", red=True)
            reporter.write_line(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ---------------------------------------------------------------- the plugin

_GUARD = pytest.StashKey[RepoGuard]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_GUARD] = RepoGuard(config.rootpath)


@pytest.fixture(autouse=True)
def repository_unchanged(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test: no tracked file of the checkout moved while it ran (RepoGuard.fixture)."""
    guard = request.config.stash.get(_GUARD, None)  # None: the plugin's hooks are off (-p no:repo_guard)
    if guard is None:
        yield
        return
    yield from guard.fixture()


def pytest_sessionfinish(session: pytest.Session) -> None:
    guard = session.config.stash.get(_GUARD, None)
    if guard is not None:
        guard.session_finished(session)
