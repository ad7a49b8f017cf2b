"""A config that the schema refuses, said in one or two lines: the key path, what is wrong, what is allowed.

snakemake.utils.validate's own error prints the whole schema and the whole config (hundreds of lines) around
the one line that matters; common.smk calls `validate_config`, which keeps Snakemake's validation (and its
default filling) and replaces only the message.
"""

from __future__ import annotations

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
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    return [describe_schema_error(e) for e in errors]


def validate_config(config: dict[str, Any], schema_path: str | Path) -> None:
    """snakemake.utils.validate (fills the schema's defaults), with a short message when it refuses."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, schema=str(schema_path))
    except WorkflowError:
        lines = config_errors(config, schema_path) or ["the config does not match the schema"]
        raise WorkflowError(
            "invalid config (schema workflow/schemas/config.schema.yaml; keys explained in config/README.md):\n"
            + "\n".join(f"  {line}" for line in lines)
        ) from None
