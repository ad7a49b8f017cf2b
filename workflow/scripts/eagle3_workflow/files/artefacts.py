"""The artefacts stages hand to each other: one pydantic model per JSON file, `write` (atomic) and `load` (checked).

A stage writes its artefact with ``write(path, Model(...))`` and the next stage (or the report, or the model card)
reads it with ``load(Model, path)``: a missing key, a value of the wrong type or a file that is not JSON fails
there, with one message that names the file, every bad field and the rule to rerun, instead of a ``KeyError``
(or a silent ``.get()`` default) three functions later. Keys a newer writer added are ignored. Field order is the
order in the file; every model's JSON is what the dataclasses it replaced wrote, key for key.

The models are kept by what they describe: the target and the API (target_artefacts: check_api, the target builds,
check_target), the training data (data_artefacts: regenerate, prepare, canary, extraction, validation) and the draft
(draft_artefacts: training, evaluation, provenance). Here: the base, `load`, `write`, and a gate's row (CheckRow).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3_workflow.files.writing import write_text_atomic
from eagle3_workflow.settings.errors import StageError, render_table

MAX_LISTED_PROBLEMS = 8


class Artefact(BaseModel):
    """A JSON file this workflow writes; `written_by` names the rule that writes it (the fix when it is bad)."""

    model_config = ConfigDict(extra="ignore")

    written_by: ClassVar[str] = ""


A = TypeVar("A", bound=Artefact)


class ArtefactError(StageError):
    """An artefact is missing, unreadable, not JSON, or not what its model says."""


def _fix(model: type[Artefact]) -> str:
    if model.written_by:
        return f"Rerun the rule that writes it: snakemake --forcerun {model.written_by} (with the run's --configfile)"
    return "Rerun the stage that writes it."


def _problem(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(the whole file)"
    if error["type"] == "missing":
        return f"{where}: missing"
    found = repr(error["input"])
    found = found if len(found) <= 60 else found[:57] + "..."
    return f"{where}: {error['msg']} (found {found})"


def validation_problems(exc: ValidationError) -> str:
    """One short line per bad field (pydantic's loc and msg), the first few of them."""
    errors = exc.errors(include_url=False)
    lines = [f"  {_problem(e)}" for e in errors[:MAX_LISTED_PROBLEMS]]
    if len(errors) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(errors) - MAX_LISTED_PROBLEMS} more")
    return "\n".join(lines)


def load(model: type[A], path: str | Path) -> A:
    """Read and check one artefact; ArtefactError names the file, each bad field and the rule to rerun."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtefactError(f"cannot read {path} ({exc!r}). {_fix(model)}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ArtefactError(f"{path} is not JSON ({exc!r}; cut short?). {_fix(model)}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc)  # not chained: pydantic's own dump (with URLs) would bury these lines
        raise ArtefactError(f"{path} is not a valid {model.__name__}:\n{problems}\n{_fix(model)}") from None


def write(path: str | Path, artefact: Artefact, *, in_place_when_full: bool = False) -> None:
    """The one writer: JSON (indent 2, keys in field order), atomically, as readable as the umask allows.
    in_place_when_full: a status file's last word, written in place on a full disk (files.writing.write_text_atomic)."""
    text = json.dumps(artefact.model_dump(), indent=2, default=str) + "\n"
    write_text_atomic(path, text, in_place_when_full=in_place_when_full)


# ----------------------------------------------------------------------------------------------- a gate's row


class CheckRow(Artefact):
    """One line of a gate's table."""

    name: str
    expected: str
    found: str
    passed: bool
    detail: str = ""


def check_table(rows: Iterable[CheckRow]) -> str:
    """A gate's rows as the table its log shows: check, expected, found, PASS/FAIL."""
    return render_table(
        ["check", "expected", "found", "pass"],
        [(r.name, r.expected, r.found, "PASS" if r.passed else "FAIL") for r in rows],
    )
