"""Docs, docstrings and error texts name test files that exist (the suite moved to tests/{unit,integration,e2e}
once, and texts naming tests/test_*.py pointed nowhere)."""

from __future__ import annotations

import ast
import re
import subprocess

from conftest import REPO

TEST_FILE = re.compile(r"\btests/[A-Za-z0-9_/]+\.py\b")


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [p for p in listed.splitlines() if p.endswith((".py", ".md", ".smk", ".yaml", ".sh")) or p == "Makefile"]


MODULE_PATH = re.compile(r"\beagle3_workflow/[A-Za-z0-9_/]+\.py\b")
DOTTED_NAME = re.compile(r"\beagle3_workflow(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
SCRIPTS = REPO / "workflow" / "scripts"


def module_file(parts: list[str]):
    path = SCRIPTS.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defined_names(path) -> set[str]:
    """What `from <module> import X` could name: its definitions, assignments and imports (submodules aside)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def names_a_module(dotted: str) -> bool:
    """A dotted name of the package (a.b[.name] under it): its longest prefix is a module, the rest at most a name it
    defines."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        found = module_file(parts[:k])
        if found is not None:
            rest = parts[k:]
            return not rest or rest[0] in defined_names(found)
    return False


def test_every_package_module_named_exists():
    """Docs, docstrings, rules and error texts name modules of the package that exist, by path
    (``eagle3_workflow/serving/server.py``) or dotted (``eagle3_workflow.serving.server.VLLMServer``, ``python -m
    eagle3_workflow.trainer.entry``): the package was regrouped by concern once (docs/architecture.md), and a name
    left at its old place points nowhere. Recorded outputs (results/, captured vLLM logs) keep what ran then."""
    missing = sorted(
        f"{path}: {name}"
        for path in tracked_text_files()
        if (REPO / path).is_file() and "/results/" not in path and not path.startswith("tests/vllm_logs/")
        for text in [(REPO / path).read_text(errors="ignore")]
        for name in {*(m for m in set(MODULE_PATH.findall(text)) if not (SCRIPTS / m).is_file())}
        | {m for m in set(DOTTED_NAME.findall(text)) if not names_a_module(m)}
    )
    assert missing == []


def test_every_test_file_named_exists():
    missing = sorted(
        f"{path}: {name}"
        for path in tracked_text_files()
        if (REPO / path).is_file()
        for name in set(TEST_FILE.findall((REPO / path).read_text(errors="ignore")))
        if not (REPO / name).exists()
    )
    assert missing == []
