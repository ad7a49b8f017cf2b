"""Stage `check_target`: ``main(snakemake)``, the rule's adapter: check_target (sanity.py) on the resolved device;
a target that answers badly stops the run with its table."""

from __future__ import annotations

import logging
from typing import Any

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import CheckTargetStage
from eagle3_workflow.settings.views import stage_settings
from eagle3_workflow.target_check.sanity import check_target, failure_message


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.serving.engine import resolve_device

    def body(log: logging.Logger) -> None:
        settings = stage_settings(CheckTargetStage, snakemake.params.settings)
        device = resolve_device(settings.vllm.device)
        report = check_target(settings, str(snakemake.input.target), device, snakemake.log[0])
        if not report.passed:
            raise StageError(failure_message(report))
        log.info("the target answers its chat template sensibly (%d questions)", len(report.answers))
        write(snakemake.output.report, report)

    run_stage("check_target", snakemake.log[0], body)
