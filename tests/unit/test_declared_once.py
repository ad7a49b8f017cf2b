"""Each config key is declared once: in workflow/schemas/config.schema.yaml, with its type, default and description.

This walks the schema and fails where the workflow's code (workflow/, Snakefile, bench/) declares a key again:

- a config path list: a string "section/key" in a rule file or in Python. A rule's params come from its stage's
  settings model (common.smk's stage_params), so no rule names keys;
- a default written again: in a rule file, `.get("key", value)` or `lookup(..., default=...)`; in Python, a
  parameter, a class field or a `.get("key", value)` named as a config key whose value is that key's schema
  default. Code that needs a default without a config reads the schema (settings.views.with_schema_defaults).

Tests are not scanned: a value a test sets is a statement of what it tests. KNOWN is empty: a copy that has to stay
for a while is named there with its reason, and an entry that no longer matches fails, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Any

import yaml
from conftest import REPO

SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
PYTHON = sorted([*(REPO / "workflow").rglob("*.py"), *(REPO / "bench").rglob("*.py")])
RULE_FILES = sorted([*(REPO / "workflow" / "rules").glob("*.smk"), REPO / "Snakefile"])

# (file, what) -> why it stays for now: copies in modules this change did not edit (another branch is changing the
# signatures of some; the others were outside its files), to remove with their next edit
KNOWN: dict[tuple[str, str], str] = {}


def schema_keys(node: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    """(path, schema) of every key, sections and the items of an array of objects (data.sources) included."""
    for key, sub in node.get("properties", {}).items():
        path = (*prefix, key)
        yield path, sub
        yield from schema_keys(sub, path)
        if "properties" in sub.get("items", {}):
            yield from schema_keys(sub["items"], path)


KEYS = dict(schema_keys(SCHEMA))
DPATHS = {"/".join(path) for path in KEYS if len(path) > 1}
DEFAULTS: dict[str, list[Any]] = {}  # key name -> the schema defaults of the keys of that name
for _path, _node in KEYS.items():
    if "default" in _node and _node["default"] is not None:
        DEFAULTS.setdefault(_path[-1], []).append(_node["default"])


def is_schema_default(name: str, value: Any) -> bool:
    """`value` is the schema's default of a key called `name` (True is not 1)."""
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in DEFAULTS.get(name, []))


def literal(node: ast.AST) -> tuple[bool, Any]:
    """(True, its value) for a literal, (False, None) for anything computed."""
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return False, None


def parameter_defaults(function: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, ast.AST]]:
    args = function.args
    positional = args.posonlyargs + args.args
    yield from (
        (a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
    )
    yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None)


def python_declarations(tree: ast.AST) -> Iterator[str]:
    """What in one Python module declares a config key again."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in DPATHS:
            yield f"config path {node.value!r}"
        named: list[tuple[str, ast.AST]] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            named = [("parameter", *pair) for pair in parameter_defaults(node)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            named = [("field", node.target.id, node.value)]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            named = [(".get", node.args[0].value, node.args[1])]
        for kind, name, value_node in named:
            ok, value = literal(value_node)
            if ok and is_schema_default(name, value):
                yield f"{kind} {name} = {value!r}"


def rule_file_declarations(text: str) -> Iterator[str]:
    """What in one rule file declares a config key again (rule files are not Python: read as text)."""
    for match in re.finditer(r"""["']([a-z_]+(?:/[a-z_]+)+)["']""", text):
        if match.group(1) in DPATHS:
            yield f"config path {match.group(1)!r}"
    for match in re.finditer(r"""\.get\(\s*["'](\w+)["']\s*,\s*([^)]+)\)""", text):
        try:
            ok, value = literal(ast.parse(match.group(2).strip(), mode="eval").body)
        except SyntaxError:
            ok, value = False, None
        if ok and is_schema_default(match.group(1), value):
            yield f".get {match.group(1)} = {value!r}"
    for _ in re.finditer(r"lookup\([^)]*\bdefault\s*=", text):
        yield "lookup(..., default=...)"


def declarations() -> set[tuple[str, str]]:
    found = set()
    for path in PYTHON:
        for what in python_declarations(ast.parse(path.read_text(), filename=str(path))):
            found.add((str(path.relative_to(REPO)), what))
    for path in RULE_FILES:
        found |= {(str(path.relative_to(REPO)), what) for what in rule_file_declarations(path.read_text())}
    return found


def test_no_config_key_is_declared_outside_the_schema():
    found = declarations()
    new = sorted(found - set(KNOWN))
    assert new == [], (
        "config keys declared outside workflow/schemas/config.schema.yaml (a rule's params come from its stage's "
        "settings model through stage_params; a default is the schema's alone):\n"
        + "\n".join(f"  {file}: {what}" for file, what in new)
    )
    gone = sorted(set(KNOWN) - found)
    assert gone == [], f"KNOWN names copies that are gone; remove them from KNOWN: {gone}"


def test_the_scan_finds_each_kind_of_copy():
    """Each pattern the test forbids, written into a module and a rule file, is found."""
    module = """
def serve(model, *, concurrency: int = 32, seed=0):
    return config["evaluate"].get("num_prompts", 32)

class Client:
    request_timeout_s: float = 600
    max_retries: int = 3
"""
    assert set(python_declarations(ast.parse(module))) == {
        "parameter concurrency = 32",
        "parameter seed = 0",
        ".get num_prompts = 32",
        "field request_timeout_s = 600",
        "field max_retries = 3",
    }
    # another value under a key's name is not its default; a value under another name is not a key
    assert list(python_declarations(ast.parse("def f(max_tokens=7, answer=32): pass"))) == []
    assert list(python_declarations(ast.parse("def f(enabled=1): pass"))) == []  # 1 is not True
    rule = """
    params:
        settings=config_subset("evaluate/num_prompts", "vllm"),
        n=config["evaluate"].get("num_prompts", 32),
        m=lookup(dpath="evaluate/max_tokens", within=config, default=128),
"""
    assert set(rule_file_declarations(rule)) == {
        "config path 'evaluate/num_prompts'",
        "config path 'evaluate/max_tokens'",
        ".get num_prompts = 32",
        "lookup(..., default=...)",
    }


def test_rules_name_their_stage_not_config_keys():
    """Each rule file hands its stages their settings through stage_params, never through a list of keys."""
    for path in RULE_FILES:
        assert "config_subset" not in path.read_text(), f"{path.name}: use stage_params(<rule>)"


def test_every_stage_model_field_is_a_key_of_the_schema():
    """The settings models are typed views of the schema, not declarations of their own: each field a stage
    reads names a schema key (tests/unit/test_settings.py checks their types)."""
    from eagle3_workflow.settings.stages import RULE_SETTINGS
    from eagle3_workflow.settings.views import View, nested_view

    def paths(model: type[View], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
        for name, field in model.model_fields.items():
            view = nested_view(field.annotation)
            yield from paths(view, (*prefix, name)) if view is not None else [(*prefix, name)]

    unknown = sorted(
        f"{model.__name__}: {'.'.join(path)}"
        for model in RULE_SETTINGS.values()
        for path in paths(model)
        if path not in KEYS
    )
    assert unknown == []
