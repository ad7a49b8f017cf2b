"""Errors a person can act on: the cause, the fix, and a readable table where there is one.

Logging and `run_stage` live in eagle3_workflow.runtime.stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
