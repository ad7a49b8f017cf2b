"""The package by concern (docs/architecture.md): stage packages on top, the concerns below them, no circle, and
nothing too long to read.

Every folder of ``eagle3_workflow`` is one package with a layer. A module may import its own package and the packages
its package's row of MAY_IMPORT names, nothing else: a stage package none of the other stages (test_stage_layout.py
says why), a concern none of the stages, and no package one above it. Every package's docstring (its __init__.py)
says what it may import, in a line ``May import: a, b, c`` that must name the same packages as its row here.

The checks are pure functions over a folder (`import_violations`, `package_cycles`, `long_modules`,
`long_functions`): the tests below run them on the package, and on small trees written into tmp_path to show that
each one fails where it must.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "workflow" / "scripts" / "eagle3_workflow"

STAGES = frozenset(
    {
        "api_checks",
        "canary",
        "evaluation",
        "extraction",
        "forecast",
        "model_card",
        "prepare",
        "provenance",
        "regenerate",
        "report",
        "target_build",
        "target_check",
        "training",
        "validation",
    }
)
CONCERNS_BELOW_STAGES = frozenset({"serving", "trainer", "reference", "runtime", "files", "settings"})
# package -> the packages it may import besides itself (top to bottom; docs/architecture.md draws these rows)
MAY_IMPORT: dict[str, frozenset[str]] = {
    **dict.fromkeys(STAGES, CONCERNS_BELOW_STAGES),
    "serving": frozenset({"runtime", "files", "settings"}),
    "trainer": frozenset({"runtime", "files", "settings"}),
    "reference": frozenset({"files", "settings"}),
    "runtime": frozenset({"files", "settings"}),
    "files": frozenset({"settings"}),
    "settings": frozenset(),
}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
# What is still too long, and why it stays for now: the goal is an empty list. An entry that is no longer too long
# fails as well (remove it), so the list always shows what is left.
LONG_MODULES_LEFT: dict[str, str] = {}  # none: evaluation/stage.py was split by concern (plan, measurements, judge)
LONG_FUNCTIONS_LEFT: dict[str, str] = {}  # none left


def modules(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def package_of(path: Path, root: Path) -> str | None:
    """The package (folder of `root`) a module belongs to; None for a module at the root."""
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else None


def imports_of(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of every import of `root`'s package in `path`: import statements anywhere (inside
    functions and TYPE_CHECKING blocks too; relative ones resolved) and importlib.import_module("...") calls."""
    name = root.name
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import: only inside the package
                here = (name, *path.relative_to(root).with_suffix("").parts)
                base = ".".join([*here[: -node.level], *([base] if base else [])])
            # from <package> import canary: the subpackage is what is imported
            found = [f"{base}.{alias.name}" for alias in node.names] if base == name else [base]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found = [node.args[0].value]
        for module in found:
            if module == name or module.startswith(name + "."):
                yield node.lineno, module


def import_violations(root: Path, may_import: Mapping[str, frozenset[str]]) -> list[str]:
    """One line per import against the direction (file:line, the import, the rule); modules outside every package
    and packages without a row are named too."""
    problems = []
    for path in modules(root):
        where = path.relative_to(root).as_posix()
        own = package_of(path, root)
        if own is None:
            if path.name != "__init__.py":
                problems.append(f"{where}: a module at the package root; move it into the package of its concern")
            continue
        if own not in may_import:
            problems.append(f"{where}: package {own!r} has no layer; give it a row in MAY_IMPORT (and its docstring)")
            continue
        for line, module in imports_of(path, root):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target is None or target == own:
                continue
            if target not in may_import[own]:
                allowed = ", ".join(sorted(may_import[own])) or "nothing of the package"
                problems.append(
                    f"{where}:{line}: imports {module}, but {own} may import only {allowed} "
                    f"(the direction of docs/architecture.md: move the shared thing down to where both may import it)"
                )
    return problems


def package_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in modules(root):
        own = package_of(path, root)
        if own is None:
            continue
        for _, module in imports_of(path, root):
            parts = module.split(".")
            if len(parts) > 1 and parts[1] != own and (root / parts[1]).is_dir():
                graph.setdefault(own, set()).add(parts[1])
    return graph


def package_cycles(root: Path) -> list[list[str]]:
    """Every circle of imports between packages (strongly connected components of more than one package)."""
    graph = package_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    return {
        path.relative_to(root).as_posix(): n
        for path in modules(root)
        if (n := len(path.read_text().splitlines())) > limit
    }


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """module:function -> lines (def to its last line, docstring included; nested functions count on their own)."""
    found = {}
    for path in modules(root):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found[f"{path.relative_to(root).as_posix()}:{node.name}"] = length
    return found


def declared_imports(init: Path) -> frozenset[str] | None:
    """The packages a package's docstring says it may import (its ``May import:`` line), None when it says none."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    match = re.search(r"^May import: ([^.(;]*)", doc, re.MULTILINE)
    if match is None:
        return None
    names = [name.strip() for name in match.group(1).split(",")]
    return frozenset() if names[0].startswith("nothing") else frozenset(names)


FROM_IMPORT = re.compile(r"^\s*from (eagle3_workflow(?:\.\w+)*) import \(?([\w, \n]+?)\)?\s*(?:#.*)?$", re.MULTILINE)


@functools.cache
def module_names(path: Path) -> set[str]:
    """The names a module defines at its top level (in if/try blocks too): what ``from it import X`` can name."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            todo += [n for handler in getattr(node, "handlers", []) for n in handler.body]
    return names


def unresolved_imports(root: Path, sources: list[Path]) -> list[str]:
    """Every ``from <package>[.x] import a, b`` line in `sources` (code, and the scripts tests write as strings) whose
    module is not a module of `root` or whose names it neither defines nor holds as submodules."""
    problems = []
    for source in sources:
        for match in FROM_IMPORT.finditer(source.read_text()):
            parts = match.group(1).split(".")[1:]
            folder = root.joinpath(*parts)
            module = folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")
            if not module.is_file():
                problems.append(f"{source}: {match.group(1)} is no module")
                continue
            defined = module_names(module)
            for name in (n.strip().split(" as ")[0] for n in match.group(2).replace("\n", ",").split(",")):
                if (
                    name
                    and name not in defined
                    and not (folder / f"{name}.py").is_file()
                    and not (folder / name).is_dir()
                ):
                    problems.append(f"{source}: {match.group(1)} has no {name}")
    return problems


# ------------------------------------------------------------------------------------------------ the package


def test_every_package_has_a_layer_and_no_import_goes_against_the_direction():
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(MAY_IMPORT)
    assert import_violations(PACKAGE, MAY_IMPORT) == []


def test_every_import_of_the_package_names_what_exists():
    """After a module moves or splits, no import (in the package, tests, bench, or a script a test writes) still names
    it at its old place: found here, without importing anything (an import of vLLM or speculators takes seconds)."""
    sources = [p for folder in ("workflow", "tests", "bench") for p in sorted((REPO / folder).rglob("*.py"))]
    assert unresolved_imports(PACKAGE, [p for p in sources if "/results/" not in p.as_posix()]) == []


def test_no_circle_between_packages():
    assert package_cycles(PACKAGE) == []


def test_every_concern_says_what_it_owns_and_may_import():
    """The docstring at the top of each concern's package names what it may import, as MAY_IMPORT does."""
    wrong = {}
    for name in sorted(CONCERNS_BELOW_STAGES):
        said = declared_imports(PACKAGE / name / "__init__.py")
        if said != MAY_IMPORT[name]:
            wrong[name] = (sorted(said) if said is not None else None, sorted(MAY_IMPORT[name]))
    assert wrong == {}, f"package: (its docstring's 'May import:' line, MAY_IMPORT's row): {wrong}"


def test_no_module_over_500_lines_but_those_left():
    found = long_modules(PACKAGE)
    assert sorted(set(found) - set(LONG_MODULES_LEFT)) == [], f"split by concern: {found}"
    stale = sorted(set(LONG_MODULES_LEFT) - set(found))
    assert stale == [], f"no longer over {MAX_MODULE_LINES} lines: remove from LONG_MODULES_LEFT: {stale}"


def test_no_function_over_60_lines_but_those_left():
    found = long_functions(PACKAGE)
    new = {name: n for name, n in found.items() if name not in LONG_FUNCTIONS_LEFT}
    assert new == {}, f"over {MAX_FUNCTION_LINES} lines (shorten by concern: name the steps as functions): {new}"
    stale = sorted(set(LONG_FUNCTIONS_LEFT) - set(found))
    assert stale == [], f"no longer over {MAX_FUNCTION_LINES} lines: remove from LONG_FUNCTIONS_LEFT: {stale}"


# ------------------------------------------------------------------------------- the checks fail where they must


def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    """A package `pkg` under `root` with one module per entry (path -> source); every folder gets an __init__.py."""
    package = root / "pkg"
    for relative, source in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == root:
                break
            (folder / "__init__.py").touch()
        path.write_text(source)
    return package


TINY_LAYERS = {
    "stage": frozenset({"serving", "settings"}),
    "serving": frozenset({"settings"}),
    "settings": frozenset(),
}


@pytest.mark.parametrize(
    ("source", "line", "module"),
    [
        ("from pkg.serving.server import Server\n", 1, "pkg.serving.server"),
        ("import pkg.serving.server\n", 1, "pkg.serving.server"),
        ("def lazy():\n    from pkg.serving import server\n", 2, "pkg.serving"),
        ("from ..serving import server\n", 1, "pkg.serving"),
        ("from pkg import serving\n", 1, "pkg.serving"),
        ("import importlib\n\nimportlib.import_module('pkg.serving.server')\n", 3, "pkg.serving.server"),
    ],
)
def test_an_import_against_the_direction_is_named_with_its_file_and_rule(tmp_path, source, line, module):
    package = write_tree(
        tmp_path,
        {
            "stage/stage.py": "from pkg.serving.server import Server\n",
            "serving/server.py": "",
            "settings/views.py": source,
        },
    )
    assert import_violations(package, TINY_LAYERS) == [
        f"settings/views.py:{line}: imports {module}, but settings may import only nothing of the package (the "
        "direction of docs/architecture.md: move the shared thing down to where both may import it)"
    ]


def test_an_import_with_the_direction_passes(tmp_path):
    package = write_tree(
        tmp_path,
        {
            "stage/stage.py": "from pkg.serving.server import Server\nfrom pkg.settings import views\n",
            "serving/server.py": "from pkg.settings.views import View\nfrom . import engine\n",
            "serving/engine.py": "",
            "settings/views.py": "from pkg.settings.errors import StageError\n",
            "settings/errors.py": "",
        },
    )
    assert import_violations(package, TINY_LAYERS) == []
    assert package_cycles(package) == []


def test_a_module_at_the_root_and_a_package_without_a_layer_are_named(tmp_path):
    package = write_tree(tmp_path, {"helpers.py": "", "misc/tools.py": "", "settings/views.py": ""})
    assert import_violations(package, TINY_LAYERS) == [
        "helpers.py: a module at the package root; move it into the package of its concern",
        "misc/__init__.py: package 'misc' has no layer; give it a row in MAY_IMPORT (and its docstring)",
        "misc/tools.py: package 'misc' has no layer; give it a row in MAY_IMPORT (and its docstring)",
    ]


def test_a_circle_between_packages_is_found_even_where_the_rows_allow_it(tmp_path):
    package = write_tree(
        tmp_path,
        {
            "files/artefacts.py": "from pkg.settings.errors import StageError\n",
            "settings/errors.py": "if False:\n    from pkg.files.artefacts import CheckRow\n",
            "runtime/child.py": "from pkg.settings.errors import StageError\n",
        },
    )
    lax = {"files": frozenset({"settings"}), "settings": frozenset({"files"}), "runtime": frozenset({"settings"})}
    assert import_violations(package, lax) == []
    assert package_cycles(package) == [["files", "settings"]]


OLD_ERRORS = "eagle3_workflow" + ".errors"  # a module's old place (written so that docs' module check skips it)


def test_an_import_of_a_name_that_moved_is_found(tmp_path):
    package = write_tree(
        tmp_path,
        {"files/artefacts.py": "class CheckRow:\n    pass\n", "settings/errors.py": "if True:\n    X = 1\n"},
    )
    user = tmp_path / "user.py"
    user.write_text(
        "from eagle3_workflow.files.artefacts import CheckRow, check_table\n"
        "from eagle3_workflow.settings.errors import X\n"
        "from eagle3_workflow.files import artefacts\n"
        f'SCRIPT = """\nfrom {OLD_ERRORS} import StageError\n"""\n'
    )
    assert unresolved_imports(package, [user]) == [
        f"{user}: eagle3_workflow.files.artefacts has no check_table",
        f"{user}: {OLD_ERRORS} is no module",
    ]


def test_long_modules_and_functions_are_found(tmp_path):
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))

    package = write_tree(tmp_path, {"files/short.py": function("fits", 60), "files/long.py": function("too_long", 61)})
    assert long_functions(package) == {"files/long.py:too_long": 61}
    assert long_modules(package, limit=60) == {"files/long.py": 61}
