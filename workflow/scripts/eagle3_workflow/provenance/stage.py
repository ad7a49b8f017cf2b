"""Stage `record_provenance`: ``main(snakemake)``, the rule's adapter: collect (collect.py) the run's provenance and
write provenance.json."""

from __future__ import annotations

import json
import logging
from typing import Any

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.provenance.collect import collect


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        record = collect(json.loads(snakemake.params.config), snakemake.params.workflow_root)
        write(snakemake.output[0], record)
        log.info("provenance: commit %s, host %s, packages %s", record.git_commit, record.host, record.packages)

    run_stage("record_provenance", snakemake.log[0], body)
