"""Stage `validate_hidden_states`: ``main(snakemake)``, the rule's adapter: every file (checks.validate_files), the
greedy cross-check of the replicas' probes (checks.greedy_cross_check), the full-depth check (full_depth), in that
order; the first that fails stops the run with its table."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.data_artefacts import ExtractionManifest
from eagle3_workflow.files.hidden_states import HiddenStateFiles, human_bytes, rows_on_disk
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.validation.checks import (
    failure_message,
    greedy_cross_check,
    greedy_failure_message,
    validate_files,
)


def main(snakemake: Any) -> None:
    import torch

    from eagle3_workflow.files.prepared import read_input_ids
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.settings.stages import online_check_samples, rule_settings_model
    from eagle3_workflow.settings.views import stage_settings
    from eagle3_workflow.validation import full_depth

    @holding_gpus(snakemake)  # reference.device cuda: the rule's one GPU (reference_gpus); else nothing to hold
    def body(log: logging.Logger) -> None:
        torch.set_num_threads(max(1, int(snakemake.threads)))
        api = load(ApiCompatReport, snakemake.input.api_compat)
        params = snakemake.params.settings
        settings = stage_settings(rule_settings_model("validate_hidden_states", params), params)
        max_bad = settings.validation.max_bad_samples
        input_ids = read_input_ids(snakemake.input.prepared)
        files = HiddenStateFiles(Path(snakemake.params.files_dir), len(api.layer_ids), api.target.hidden_size)
        rows = rows_on_disk([len(ids) for ids in input_ids], online_check_samples(settings))
        report = validate_files(input_ids, files, max_bad_samples=max_bad, rows=rows)
        log.info(
            "validated %d/%d samples, %d tokens, %s",
            report.samples_valid,
            report.samples_expected,
            report.tokens,
            human_bytes(report.bytes),
        )
        if not report.passed:
            raise StageError(failure_message(report, max_bad))
        probes = [p for path in snakemake.input.manifests for p in load(ExtractionManifest, path).greedy_probes]
        report.greedy_check = greedy_cross_check(Path(snakemake.input.target), Path(snakemake.params.files_dir), probes)
        if not probes:
            log.warning("greedy-token cross-check: no probes in the replica manifests (nothing was extracted this run)")
        elif not all(r.ok for r in report.greedy_check):
            raise StageError(greedy_failure_message(report.greedy_check))
        else:
            log.info("greedy-token cross-check: %d/%d samples give the server's token", len(probes), len(probes))
        unusable = set(report.missing) | {int(row) for row in report.bad}
        report.full_depth = full_depth.check_stage(
            settings,
            target_dir=Path(snakemake.input.target),
            files_dir=Path(snakemake.params.files_dir),
            samples={row: input_ids[row] for row in rows if row not in unusable},
            layer_ids=api.layer_ids,
        )
        write(snakemake.output.report, report)

    run_stage("validate_hidden_states", snakemake.log[0], body)
