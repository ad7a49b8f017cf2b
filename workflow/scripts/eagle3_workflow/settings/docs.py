"""config/README.md's table of keys, written from the schema: `make config-docs`.

The schema (workflow/schemas/config.schema.yaml) is the one place a config key is declared: its type, its default
and its description. This module renders them as the table between the README's two markers, one row per key in
the schema's order, a header row per section (its ``title`` and ``description``). tests/unit/test_config_docs.py
fails when the README's table is not the one the schema gives.

    PYTHONPATH=workflow/scripts python -m eagle3_workflow.settings.docs [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[4]
SCHEMA_PATH = REPO / "workflow" / "schemas" / "config.schema.yaml"
README_PATH = REPO / "config" / "README.md"
BEGIN = (
    "<!-- keys: written from workflow/schemas/config.schema.yaml by `make config-docs`; "
    "edit the schema's descriptions, not this table -->"
)
END = "<!-- end of keys -->"


def is_section(node: dict[str, Any]) -> bool:
    """An object whose keys are listed one by one (a section, or target.build)."""
    return "properties" in node and node.get("type", "object") == "object"


def default_cell(node: dict[str, Any], required: bool) -> str:
    """The schema's default as YAML would write it in a config (a string bare); `required` or `-` without one."""
    if "default" not in node:
        return "required" if required else "-"
    value = node["default"]
    return value if isinstance(value, str) else json.dumps(value)


def row(*cells: str) -> str:
    """A table row; each cell on one line, no column break in it."""
    texts = (" ".join(c.split()).replace("|", "\\|") for c in cells)
    return "|" + "|".join(f" {t} " if t else " " for t in texts) + "|"


def rows(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    required = set(node.get("required", ())) if not prefix else set()  # below the top, "required" is conditional
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        description = sub.get("description", "")
        if is_section(sub):
            title = f" ({sub['title']})" if "title" in sub else ""
            yield row(f"**{path}**{title}", "", description)
            yield from rows(sub, path)
        else:
            yield row(f"`{path}`", default_cell(sub, key in required), description)


def keys_table(schema: dict[str, Any]) -> str:
    """The README's table: every key of `schema` with its default and description."""
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows(schema)])


def with_table(readme: str, schema: dict[str, Any]) -> str:
    """`readme` with the text between its markers replaced by the table of `schema`."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"config/README.md has lost its markers; put back\n{BEGIN}\n{END}\naround the table of keys")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{keys_table(schema)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if config/README.md is not up to date")
    args = parser.parse_args(argv)
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    readme = README_PATH.read_text()
    written = with_table(readme, schema)
    if args.check:
        if written != readme:
            print("config/README.md's table differs from the schema; run `make config-docs`", file=sys.stderr)
            return 1
        return 0
    if written != readme:
        README_PATH.write_text(written)
        print(f"wrote the table of keys into {README_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
