"""Errors a person can act on: the cause, the fix, and a readable table where there is one."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


class StageError(RuntimeError):
    """A stage refuses to write its artefact. The message says what is wrong and how to fix it."""


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Plain-text table for logs (no colour, fixed-width, survives `less` and SLURM logs).

    Cells longer than the column limit wrap onto continuation lines instead of being cut: the end of a
    detail (the offending keys, the fix) is often the part a person needs.
    """
    import textwrap

    limit = 80
    text_rows = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            longest = max((len(part) for part in cell.splitlines()), default=0)
            widths[i] = min(max(widths[i], longest), limit)

    def lines(cells: Sequence[str]) -> list[str]:
        wrapped = [
            [piece for part in (c.splitlines() or [""]) for piece in (textwrap.wrap(part, widths[i]) or [""])]
            for i, c in enumerate(cells)
        ]
        height = max(len(w) for w in wrapped)
        return [
            " | ".join((w[k] if k < len(w) else "").ljust(widths[i]) for i, w in enumerate(wrapped)).rstrip()
            for k in range(height)
        ]

    out = [*lines(headers), "-+-".join("-" * w for w in widths)]
    for row in text_rows:
        out.extend(lines(row))
    return "\n".join(out)


def describe_exception(exc: BaseException) -> str:
    """repr() plus the full traceback: never the bare `str(e)`, which can be empty."""
    return f"{exc!r}\n{''.join(traceback.format_exception(exc))}"


def setup_logging(log_path: str | Path | None = None) -> logging.Logger:
    """Log to stderr and, when given, to the rule's log file (both keep everything)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="a"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    return logging.getLogger("eagle3")


def run_stage(name: str, log_path: str | Path | None, body: Callable[[logging.Logger], object]) -> None:
    """Run a stage body; on failure log the cause (repr + traceback) and exit non-zero.

    Snakemake deletes declared outputs of a failed job, and stages write their artefact last, so a failed
    stage never leaves a file the next stage could mistake for success.
    """
    log = setup_logging(log_path)
    log.info("stage %s: start", name)
    try:
        body(log)
    except StageError as exc:
        log.error("stage %s FAILED:\n%s", name, exc)
        log.debug("%s", describe_exception(exc))
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - the point is to report anything, loudly
        log.error("stage %s FAILED with an unexpected error:\n%s", name, describe_exception(exc))
        sys.exit(1)
    log.info("stage %s: done", name)
