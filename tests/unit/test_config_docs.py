"""config/README.md's table of keys and the schema say the same thing.

- The table is the one eagle3_workflow.settings.docs writes from the schema (`make config-docs`), and every key of
  the schema has a description to write.
- Read on its own, the table lists every key of the schema, no key the schema lacks, each with the schema's
  default: a check of the README as a reader sees it, independent of the generator.
"""

from __future__ import annotations

import copy
import difflib

import pytest
import yaml
from conftest import REPO

from eagle3_workflow.settings import docs as config_docs

SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
README = REPO / "config" / "README.md"
NO_DEFAULT = {"required", "-"}


def schema_keys(node: dict, prefix: str = "") -> dict[str, dict]:
    """Every key path of the schema (dotted) -> its schema; objects with properties are expanded, not listed."""
    found = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        if "properties" in sub and sub.get("type", "object") == "object":
            found |= schema_keys(sub, path)
        else:
            found[path] = sub
    return found


def readme_rows(text: str) -> list[tuple[list[str], str]]:
    """(key paths, default cell) of the table's rows that name config keys (`a.b / c` names a.b and a.c)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`") or not cells[0].endswith("`"):
            continue
        names = [n.strip() for n in cells[0].strip("`").split(" / ")]
        first = names[0].removesuffix("[]")
        parent = first.rsplit(".", 1)[0] if "." in first else ""
        keys = [first] + [f"{parent}.{n}" if parent else n for n in names[1:]]
        rows.append((keys, cells[1]))
    return rows


def disagreements(readme: str, schema: dict) -> dict[str, str]:
    """key -> what is wrong: documented but not in the schema, in the schema but not documented, another default."""
    keys = schema_keys(schema)
    listed: dict[str, str] = {}
    wrong = {}
    for names, cell in readme_rows(readme):
        values = [v.strip() for v in cell.split(" / ")]
        if len(values) == 1:
            values *= len(names)
        if len(values) != len(names):
            wrong[" / ".join(names)] = f"{len(names)} keys but {len(values)} defaults: {cell!r}"
            continue
        listed |= dict(zip(names, values, strict=True))
    for name, value in listed.items():
        if name not in keys:
            wrong[name] = "in config/README.md, not a key of the schema"
        elif "default" not in keys[name]:
            if value not in NO_DEFAULT:
                wrong[name] = f"the schema has no default; the table says {value!r} (write 'required' or '-')"
        elif value in NO_DEFAULT or not value or yaml.safe_load(value) != keys[name]["default"]:
            wrong[name] = f"the table says {value!r}, the schema's default is {keys[name]['default']!r}"
    for name in sorted(set(keys) - set(listed)):
        wrong[name] = "a key of the schema, not in config/README.md"
    return wrong


def test_readme_table_is_the_one_the_schema_gives():
    readme = README.read_text()
    written = config_docs.with_table(readme, SCHEMA)
    diff = "\n".join(difflib.unified_diff(readme.splitlines(), written.splitlines(), "README", "schema", lineterm=""))
    assert written == readme, f"config/README.md's table is not the schema's; run `make config-docs`:\n{diff}"


def test_every_key_of_the_schema_has_a_description():
    undescribed = sorted(path for path, node in schema_keys(SCHEMA).items() if not node.get("description", "").strip())
    assert undescribed == [], "describe these keys in workflow/schemas/config.schema.yaml (their README row)"


def test_readme_table_lists_every_key_with_the_schemas_default():
    assert disagreements(README.read_text(), SCHEMA) == {}


def test_a_key_documented_but_not_in_the_schema_or_the_reverse_fails():
    readme = README.read_text()
    extra_row = readme.replace("| `run` |", "| `train.warmup_steps` | 0 | not a key |\n| `run` |", 1)
    assert disagreements(extra_row, SCHEMA) == {"train.warmup_steps": "in config/README.md, not a key of the schema"}
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["train"]["properties"]["warmup_steps"] = {"type": "integer", "default": 0}
    assert disagreements(readme, schema) == {"train.warmup_steps": "a key of the schema, not in config/README.md"}
    other_default = readme.replace("| `train.lr` | 0.0001 |", "| `train.lr` | 0.001 |")
    assert "train.lr" in disagreements(other_default, SCHEMA)


def test_the_table_follows_a_new_key_and_its_description():
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["train"]["properties"]["warmup_steps"] = {
        "type": "integer",
        "default": 0,
        "description": "steps of linear warm-up",
    }
    written = config_docs.with_table(README.read_text(), schema)
    assert "| `train.warmup_steps` | 0 | steps of linear warm-up |" in written
    assert disagreements(written, schema) == {}


def test_a_readme_without_its_markers_is_refused_naming_them():
    with pytest.raises(ValueError, match="lost its markers"):
        config_docs.with_table("# Configuration\n", SCHEMA)
