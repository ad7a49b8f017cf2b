"""docs/benchmarks.md and docs/gpu.md stay recipes, not diaries (issue 45): short, one current table per figure with
its date, commit and script, and every history file they send a reader to exists and is linked.

Whether a figure was lost on the way is a question for the git history: bench/check_docs_history.py answers it in a
clone; these tests read the committed files only.
"""

from __future__ import annotations

import re

from conftest import REPO

LINE_LIMITS = {"docs/benchmarks.md": 300, "docs/gpu.md": 200}
DOC_PATH = re.compile(r"\b(?:bench|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")
SCRIPT = re.compile(r"`(?:[^`]*\s)?(?:bench/[^`\s]+|make [a-z-]+|\./\.ci/run)")
RESULTS = REPO / "bench/gpu/results"


def read(path: str) -> str:
    return (REPO / path).read_text()


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    return {part.splitlines()[0]: part for part in parts}


def test_the_recipes_stay_short():
    too_long = {path: n for path, limit in LINE_LIMITS.items() if (n := len(read(path).splitlines())) >= limit}
    assert too_long == {}, f"over the limits {LINE_LIMITS}: move the history to bench/ (docs/benchmarks.md says where)"


def test_every_bench_or_docs_path_the_recipes_name_exists():
    missing = sorted(
        f"{doc}: {name}"
        for doc in ("docs/benchmarks.md", "docs/gpu.md", "docs/gpu-local.md", "README.md")
        for name in set(DOC_PATH.findall(read(doc)))
        if "<" not in name and not (REPO / name).exists()
    )
    assert missing == []


def test_every_table_of_benchmarks_says_when_at_which_commit_by_which_script():
    unsourced = sorted(
        title
        for title, body in sections(read("docs/benchmarks.md")).items()
        if "\n|---" in body and not (DATE.search(body) and COMMIT.search(body) and SCRIPT.search(body))
    )
    assert unsourced == []


def test_every_history_file_is_linked_from_the_current_docs():
    """The run folders through the leases' index, which both recipes name; the other history files by name."""
    benchmarks, gpu = read("docs/benchmarks.md"), read("docs/gpu.md")
    index = read("bench/gpu/results/README.md")
    assert "bench/gpu/results/README.md" in benchmarks and "bench/gpu/results/README.md" in gpu
    unindexed = sorted(run.name for run in RESULTS.iterdir() if run.is_dir() and f"results/{run.name}/" not in index)
    assert unindexed == []
    other_history = sorted(
        path.relative_to(REPO).as_posix()
        for pattern in ("bench/*/README.md", "bench/*/HISTORY.md")
        for path in REPO.glob(pattern)
    )
    assert "bench/suite/HISTORY.md" in other_history
    assert [path for path in other_history if path not in benchmarks] == []
