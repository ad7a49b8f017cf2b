"""Every stage has one shape (README.md, "Code map"): a package ``eagle3_workflow/<stage>/`` whose pure modules do the
work and whose ``stage.py`` is the only module that touches ``snakemake``; its rule's entry script
(workflow/scripts/<rule>.py) imports the adapter from ``<stage>.stage``. A stage package is a folder of the package
holding a ``stage.py``.

No module outside a stage's package imports it: what two stages share (the hidden-state client of canary and
extraction, vLLM's spec-decode metric names of check_api and evaluate_draft, the streamed full-depth reference of
check_api and validate_hidden_states) lives in the package of its concern below the stages (serving, reference, ...;
tests/unit/test_package_layout.py checks the direction). Tests, bench/ and the entry scripts drive the
stages and may import them. An import through ``importlib.import_module("eagle3_workflow....")`` counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import REPO
from test_package_layout import imports_of

SCRIPTS = REPO / "workflow" / "scripts"
PACKAGE = SCRIPTS / "eagle3_workflow"


def takes_snakemake(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
        arg.arg == "snakemake" for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    )


def is_stage_package(folder: Path) -> bool:
    """A folder with a stage.py holding a rule's adapter (runtime/stage.py, the stages' shared runner, has none)."""
    stage = folder / "stage.py"
    return stage.is_file() and any(takes_snakemake(node) for node in ast.parse(stage.read_text()).body)


STAGE_PACKAGES = sorted(folder.name for folder in PACKAGE.iterdir() if is_stage_package(folder))
# top-level helpers an adapter hands its snakemake object to
ADAPTER_HELPERS = {"runtime/gpu_placement.py"}

# (importing module, imported stage package) -> why it stays for now; an entry that no longer matches fails too
KNOWN: dict[tuple[str, str], str] = {}


def package_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def entry_scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("*.py"))


def imported_modules(path: Path) -> Iterator[str]:
    """Every eagle3_workflow module `path` imports (test_package_layout.imports_of: import statements, relative ones
    resolved, and ``import_module("...")`` calls with a literal name)."""
    return (module for _, module in imports_of(path, PACKAGE))


def stage_package_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "eagle3_workflow" and parts[1] in STAGE_PACKAGES:
        return parts[1]
    return None


def owner(path: Path) -> str | None:
    """The package folder of the eagle3_workflow module at `path` (None: the package's own __init__.py)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def cross_stage_imports() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in package_modules():
        for module in imported_modules(path):
            stage = stage_package_of(module)
            if stage is not None and stage != owner(path):
                found.setdefault((path.relative_to(PACKAGE).as_posix(), stage), []).append(module)
    return found


def test_the_stage_packages_are_found():
    assert {"training", "evaluation", "regenerate", "report"} <= set(STAGE_PACKAGES), STAGE_PACKAGES


def test_no_module_imports_another_stages_package():
    found = cross_stage_imports()
    unexplained = {key: sorted(set(modules)) for key, modules in found.items() if key not in KNOWN}
    assert unexplained == {}, (
        "move what two stages share into the package of its concern (module, stage package it imports): "
        + repr(unexplained)
    )
    stale = sorted(set(KNOWN) - set(found))
    assert stale == [], f"KNOWN entries that no longer match (remove them): {stale}"


def test_every_entry_script_imports_its_adapter_from_a_stage_module():
    wrong = {}
    for script in entry_scripts():
        modules = [m for m in imported_modules(script) if m.startswith("eagle3_workflow")]
        good = [m for m in modules if stage_package_of(m) is not None and m.split(".")[2:] == ["stage"]]
        if not good or len(good) != len(modules):
            wrong[script.name] = modules
    assert wrong == {}, f"entry scripts must import only from eagle3_workflow.<stage package>.stage: {wrong}"


def test_only_stage_modules_take_snakemake():
    takers = sorted(
        f"{path.relative_to(PACKAGE).as_posix()}:{node.name}"
        for path in package_modules()
        if path.name != "stage.py" and path.relative_to(PACKAGE).as_posix() not in ADAPTER_HELPERS
        for node in ast.walk(ast.parse(path.read_text()))
        if takes_snakemake(node)
    )
    assert takers == [], f"only a stage package's stage.py reads snakemake: {takers}"
