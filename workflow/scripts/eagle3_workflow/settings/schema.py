"""A config that the schema refuses, said in one or two lines: the key path, what is wrong, what is allowed.

snakemake.utils.validate's own error prints the whole schema and the whole config (hundreds of lines) around
the one line that matters; common.smk calls `validate_config`, which validates as Snakemake's validate does (its
JSON Schema draft and its default filling) and replaces only the message.

The schema is read once per process, not once per call as snakemake.utils.validate does (a pure-Python YAML parse
of the 44 kB schema, about 40 ms): the in-process dry runs of tests/integration/test_rerun_planning.py and the
settings helpers of tests and benches validate hundreds of times. Defaults are copied into the config, never shared
with the cached schema. tests/unit/test_config.py checks that the result equals snakemake.utils.validate's.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any


def _key_path(path: Any) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def describe_schema_error(error: Any) -> str:
    """One jsonschema ValidationError as `key path: problem (allowed: ...)`. Pure."""
    where = _key_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        keys = ", ".join(f"{where}.{k}" if error.absolute_path else k for k in unknown)
        return (
            f"unknown key {keys}; allowed keys{'' if not error.absolute_path else ' in ' + where}: {', '.join(allowed)}"
        )
    if error.validator == "enum":
        return f"{where}: {error.instance!r} is not one of {error.validator_value}"
    if error.validator == "required":
        return f"{where}: {error.message}"
    return f"{where}: {error.message}"


def config_errors(config: dict[str, Any], schema_path: str | Path) -> list[str]:
    """Every schema violation of `config`, one line each, sorted by key path."""
    from jsonschema import Draft202012Validator

    schema = load_schema(schema_path)
    errors = sorted(Draft202012Validator(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    return [describe_schema_error(e) for e in errors]


def load_schema(schema_path: str | Path) -> dict[str, Any]:
    """The schema at `schema_path`, parsed once per process and version of the file (its size and mtime: an edited
    schema is read again). Callers must not change it."""
    path = Path(schema_path).resolve()
    stat = path.stat()
    return _parsed_schema(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed_schema(path: Path, mtime_ns: int, size: int) -> dict[str, Any]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML was built with it
    schema = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
    schema["$id"] = path.as_uri()  # as snakemake.utils.validate does: any relative $ref resolves beside the file
    return schema


@functools.cache
def _filling_validator() -> Any:
    """Draft 2020-12 (the draft snakemake.utils.validate uses) extended to fill each property's default, as
    Snakemake's validate does (jsonschema's FAQ recipe), with a copy of the default: the config must not share
    a list or mapping with the cached schema."""
    from jsonschema import Draft202012Validator, validators

    validate_properties = Draft202012Validator.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        for name, subschema in properties.items():
            if "default" in subschema:
                instance.setdefault(name, copy.deepcopy(subschema["default"]))
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})


def validate_config(config: dict[str, Any], schema_path: str | Path) -> None:
    """Validate `config` and fill the schema's defaults into it, as snakemake.utils.validate(config, schema) does,
    with a short message when it refuses."""
    from jsonschema import ValidationError
    from snakemake.exceptions import WorkflowError

    try:
        _filling_validator()(load_schema(schema_path)).validate(config)
    except ValidationError:
        lines = config_errors(config, schema_path) or ["the config does not match the schema"]
        raise WorkflowError(
            "invalid config (schema workflow/schemas/config.schema.yaml; keys explained in config/README.md):\n"
            + "\n".join(f"  {line}" for line in lines)
        ) from None
