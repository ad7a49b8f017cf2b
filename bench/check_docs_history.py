"""Nothing measured lost when the docs became recipes (issue 45): every line with a figure in the docs of a past
commit is still in the docs or in a history file they link to.

    python bench/check_docs_history.py [--ref 26be8c9] [--files docs/benchmarks.md docs/gpu.md README.md]

A line of the old file counts as a figure line when it holds a digit. It is found when, with leading '#'s and
runs of whitespace collapsed, it is a substring of the current corpus (docs/*.md, README.md and every .md file
under bench/, joined by spaces so that a paragraph moved as it was matches wherever its lines break). A line not
found so is found "as figures" when every number it holds appears in one paragraph or table row of the corpus (a
table row rewritten with the same numbers). Anything else is printed as lost, and the exit status is 1.

It also checks that each file holding moved text is reachable from the current docs: named in docs/benchmarks.md
or docs/gpu.md, or a run folder's README listed in bench/gpu/results/README.md, which both name.

Needs the git history (`git show REF:path`); run it from a clone, not in CI (tests/unit/test_docs_recipes.py
checks what the committed files alone can show).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"\d(?:[\d,.]*\d)?")
HISTORY_FILES = ("bench/**/README.md", "bench/**/HISTORY.md")


def normalize(line: str) -> str:
    return " ".join(line.lstrip("#").split())


def old_lines(ref: str, path: str) -> list[str]:
    shown = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=REPO, capture_output=True, text=True, check=True)
    return shown.stdout.splitlines()


def corpus_files() -> list[Path]:
    files = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    for pattern in HISTORY_FILES:
        files += sorted(REPO.glob(pattern))
    return sorted(set(files))


def blocks(text: str) -> list[str]:
    """Paragraphs, and each table row on its own."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        rows = [line for line in para.splitlines() if line.lstrip().startswith("|")]
        out += rows if rows else [para]
    return out


def figures(line: str) -> set[str]:
    return set(NUMBER.findall(line))


def check(ref: str, paths: list[str]) -> int:
    files = corpus_files()
    texts = {f: f.read_text() for f in files}
    joined = " ".join(normalize(line) for text in texts.values() for line in text.splitlines())
    all_blocks = [(f, b, figures(b)) for f, text in texts.items() for b in blocks(text)]
    lost = 0
    for path in paths:
        verbatim = as_figures = 0
        for number, line in enumerate(old_lines(ref, path), 1):
            if not re.search(r"\d", line):
                continue
            if normalize(line) in joined:
                verbatim += 1
                continue
            wanted = figures(line)
            if any(wanted <= have for _, _, have in all_blocks):
                as_figures += 1
                continue
            lost += 1
            print(f"LOST {path}:{number}: {line.strip()}")
        print(f"{path} at {ref}: {verbatim} figure lines found verbatim, {as_figures} as figures")
    unreachable = unlinked_history()
    for f in unreachable:
        print(f"UNLINKED {f}: holds history but no current doc names it")
    print(f"{lost} figure lines lost, {len(unreachable)} history files unlinked")
    return 1 if lost or unreachable else 0


def unlinked_history() -> list[str]:
    named = (REPO / "docs/benchmarks.md").read_text() + (REPO / "docs/gpu.md").read_text()
    index = (REPO / "bench/gpu/results/README.md").read_text()
    missing = []
    for pattern in HISTORY_FILES:
        for f in sorted(REPO.glob(pattern)):
            rel = f.relative_to(REPO).as_posix()
            if rel in named or rel.removesuffix("README.md") in named:
                continue
            run_folder = rel.removesuffix("/README.md").removeprefix("bench/gpu/results/")
            if rel.startswith("bench/gpu/results/") and run_folder in index and "bench/gpu/results/" in named:
                continue
            missing.append(rel)
    return missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="26be8c9", help="the commit whose docs must not lose a figure")
    parser.add_argument("--files", nargs="+", default=["docs/benchmarks.md", "docs/gpu.md", "README.md"])
    args = parser.parse_args()
    sys.exit(check(args.ref, args.files))


if __name__ == "__main__":
    main()
