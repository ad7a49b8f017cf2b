"""Stage `check_api`: ``main(snakemake)``, the rule's adapter: the settings into run_api_checks (checks.py), a failed
check stops the run with its table and advice, a passed one writes checks/api_compat.json."""

from __future__ import annotations

import logging
from typing import Any

from eagle3_workflow.api_checks.checks import failure_advice, run_api_checks, trainer_fields_used
from eagle3_workflow.api_checks.vllm_surfaces import eagle3_capable_architectures
from eagle3_workflow.files.artefacts import check_table, write
from eagle3_workflow.settings.errors import StageError


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.serving.engine import resolve_device
    from eagle3_workflow.settings.stages import CheckApiStage
    from eagle3_workflow.settings.views import stage_settings

    def body(log: logging.Logger) -> None:
        settings = stage_settings(CheckApiStage, snakemake.params.settings)
        report = run_api_checks(
            target_dir=str(snakemake.input.target),
            prepared_dir=str(snakemake.input.prepared),
            configured_layer_ids=settings.hidden_states.layer_ids,
            vllm_min=settings.check_api.vllm_min,
            vllm_max_exclusive=settings.check_api.vllm_max_exclusive,
            device=resolve_device(settings.vllm.device),
            trust_remote_code=settings.target.trust_remote_code,
            trainer_fields=trainer_fields_used(),
            full_depth_check=settings.validation.full_depth_check,
            canary_reference=settings.canary.reference,
        )
        table = check_table(report.checks)
        if not report.passed:
            failed = [r for r in report.checks if not r.passed]
            architecture_failed = any(r.name == "target architecture" for r in failed)
            capable = eagle3_capable_architectures() if architecture_failed else None
            raise StageError(
                f"API compatibility check failed ({len(failed)} of {len(report.checks)}):\n{table}\n"
                f"{failure_advice(failed, capable)}"
            )
        log.info("API compatibility: all %d checks pass\n%s", len(report.checks), table)
        write(snakemake.output.report, report)

    run_stage("check_api", snakemake.log[0], body)
