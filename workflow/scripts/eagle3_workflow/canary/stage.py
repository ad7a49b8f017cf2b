"""Stage `canary`: ``main(snakemake)``, the rule's adapter: the settings and api_compat.json into a CanaryRequest,
run_canary (check.py), the report written, or the run stopped with its table."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.canary.check import (
    CanaryRequest,
    client_settings,
    pick_samples,
    refuse_or_log,
    run_canary,
    server_spec_factory,
)
from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import CanaryStage
from eagle3_workflow.settings.views import stage_settings


def main(snakemake: Any) -> None:
    from eagle3_workflow.reference.full_depth import reference_device
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        settings = stage_settings(CanaryStage, snakemake.params.settings)
        api = load(ApiCompatReport, snakemake.input.api_compat)
        if not api.passed:
            raise StageError("api_compat.json says passed=false; the canary will not start")
        canary = settings.canary
        if canary.reference == "hf_fp32":
            reference_device(settings.reference.device)  # a device this job lacks fails now, not after the server
        samples, messages = pick_samples(
            Path(snakemake.input.prepared), canary.num_samples, canary.max_tokens_per_sample
        )
        request = CanaryRequest(
            target_dir=Path(snakemake.input.target),
            work_dir=Path(snakemake.params.work_dir),
            samples=samples,
            messages=messages,
            spec_factory=server_spec_factory(settings, api.device),
            server_log=Path(snakemake.log[0]),
            device=api.device,
            client=client_settings(settings.extraction),
            canary_layers=canary.num_layers,
            tolerance=canary.relative_tolerance,
            render_samples=canary.render_samples,
            trust_remote_code=settings.target.trust_remote_code,
            reference=canary.reference,
            reference_device=settings.reference.device,
        )
        report = run_canary(request)
        refuse_or_log(report, log)
        write(snakemake.output.report, report)

    run_stage("canary", snakemake.log[0], body)
