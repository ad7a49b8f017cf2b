"""Code a newcomer can read (issue #45): no function over 60 lines and no module over 500 in the packages held to it.
A long function is split into named steps, a long module by concern (evaluation/: plan, measurements, judge)."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO

PACKAGE = REPO / "workflow" / "scripts" / "eagle3_workflow"
# the packages held to the limits so far; the rest of eagle3_workflow joins as it is split
CHECKED = ["evaluation"]
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def modules(package: str) -> list:
    return sorted((PACKAGE / package).rglob("*.py"))


@pytest.mark.parametrize("package", CHECKED)
def test_no_module_is_over_its_limit(package):
    long = {p.relative_to(PACKAGE).as_posix(): n for p in modules(package) if (n := len(p.read_text().splitlines()))
            > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("package", CHECKED)
def test_no_function_is_over_its_limit(package):
    long = {
        f"{path.relative_to(PACKAGE).as_posix()}:{node.name}": node.end_lineno - node.lineno + 1
        for path in modules(package)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {long}"
