"""Stage `validate_hidden_states`: every sample file is checked before training may read it.

Checks per file: keys, shape [T, L, H] with the captured L and the target's H, float dtype, finite,
non-constant, token_ids equal to the prepared input_ids. Missing or bad samples above
validation.max_bad_samples (default 0) fail the stage with a table of what is wrong.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.contracts import ValidationReport, read_json, write_json_atomic
from eagle3_workflow.errors import StageError, render_table
from eagle3_workflow.hidden_states import check_file, hs_file, human_bytes

MAX_LISTED = 50


def validate_files(
    input_ids: list[list[int]], files_dir: Path, *, layer_count: int, hidden_size: int, max_bad_samples: int = 0
) -> ValidationReport:
    missing: list[int] = []
    bad: dict[str, str] = {}
    tokens = size = valid = 0
    for row, ids in enumerate(input_ids):
        path = hs_file(files_dir, row)
        reason = check_file(path, ids, layer_count, hidden_size, full=True)
        if reason == "missing":
            missing.append(row)
        elif reason is not None:
            bad[str(row)] = reason
        else:
            valid += 1
            tokens += len(ids)
            size += path.stat().st_size
    failures = len(missing) + len(bad)
    return ValidationReport(
        passed=failures <= max_bad_samples,
        samples_expected=len(input_ids),
        samples_valid=valid,
        missing=missing,
        bad=bad,
        tokens=tokens,
        bytes=size,
        layer_count=layer_count,
        hidden_size=hidden_size,
        files_dir=[str(files_dir)],
    )


def failure_message(report: ValidationReport, max_bad_samples: int) -> str:
    rows = [(row, "missing") for row in report.missing[:MAX_LISTED]]
    rows += [(row, reason) for row, reason in list(report.bad.items())[:MAX_LISTED]]
    table = render_table(["row", "problem"], rows)
    return (
        f"{len(report.missing)} missing and {len(report.bad)} bad hidden-state files of {report.samples_expected} "
        f"(allowed: {max_bad_samples}):\n{table}\n"
        "Rerun extraction for the affected replica (it redoes invalid files and keeps valid ones), e.g. "
        "`snakemake --forcerun extract_hidden_states ...`; raise validation.max_bad_samples only if you accept "
        "training without those samples."
    )


def main(snakemake: Any) -> None:
    from eagle3_workflow.errors import run_stage
    from eagle3_workflow.extraction import load_prepared_input_ids

    def body(log: logging.Logger) -> None:
        api = read_json(snakemake.input.api_compat)
        max_bad = snakemake.config["validation"]["max_bad_samples"]
        report = validate_files(
            load_prepared_input_ids(snakemake.input.prepared),
            Path(snakemake.params.files_dir),
            layer_count=len(api["layer_ids"]),
            hidden_size=api["target"]["hidden_size"],
            max_bad_samples=max_bad,
        )
        log.info(
            "validated %d/%d samples, %d tokens, %s",
            report.samples_valid,
            report.samples_expected,
            report.tokens,
            human_bytes(report.bytes),
        )
        if not report.passed:
            raise StageError(failure_message(report, max_bad))
        write_json_atomic(snakemake.output.report, report)

    run_stage("validate_hidden_states", snakemake.log[0], body)
