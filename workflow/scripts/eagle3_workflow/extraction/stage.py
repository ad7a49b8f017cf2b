"""Stage `extract_hidden_states`: ``main(snakemake)``, the rule's adapter: the gates' artefacts and the settings
into one ReplicaRequest, extract_replica (replica.py), the manifest written."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica, server_spec_factory
from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.data_artefacts import CanaryReport
from eagle3_workflow.files.hidden_states import HiddenStateFiles, human_bytes
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import online_check_samples, rule_settings_model
from eagle3_workflow.settings.views import stage_settings


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        params = snakemake.params.settings
        settings = stage_settings(rule_settings_model("extract_hidden_states", params), params)
        extraction = settings.extraction
        api = load(ApiCompatReport, snakemake.input.api_compat)
        canary = load(CanaryReport, snakemake.input.canary)
        if not api.passed or not canary.passed:
            raise StageError(
                "the gates did not pass (api_compat.json / canary.json say passed=false); extraction will not start"
            )
        replica = int(snakemake.wildcards.replica)
        request = ReplicaRequest(
            prepared_dir=Path(snakemake.input.prepared),
            replica=replica,
            replicas=extraction.replicas,
            files=HiddenStateFiles(Path(snakemake.params.files_dir), len(api.layer_ids), api.target.hidden_size),
            scratch_dir=Path(snakemake.params.scratch_dir),
            server_spec_factory=server_spec_factory(settings, api, str(snakemake.input.target)),
            server_log=Path(snakemake.log[0]),
            disk_margin=extraction.disk_margin,
            available_bytes_override=extraction.available_bytes_override,
            probe_samples=extraction.greedy_probe_samples,
            progress_path=Path(snakemake.params.progress),
            manifest_path=Path(snakemake.output.manifest),
            online_check_samples=online_check_samples(settings),
        )
        manifest = extract_replica(request, client_settings(extraction))
        log.info(
            "replica %d: %d extracted, %d reused, %s written, %.0f tok/s",
            replica,
            manifest.samples_extracted,
            manifest.samples_reused,
            human_bytes(manifest.bytes_written),
            manifest.tokens_per_s,
        )

    run_stage("extract_hidden_states", snakemake.log[0], body)
