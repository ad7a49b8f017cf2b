"""Stage `package_draft`: ``main(snakemake)``, the rule's adapter: package_draft (card.py) into published_draft/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_workflow.model_card.card import package_draft
from eagle3_workflow.settings.stages import PackageDraftStage


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.settings.views import stage_settings

    def body(log) -> None:
        paths = {name: Path(value) for name, value in snakemake.input.items()}
        settings = stage_settings(PackageDraftStage, snakemake.params.settings)
        out_dir = package_draft(paths, settings, Path(snakemake.output.published))
        log.info("published draft: %s (%s)", out_dir, ", ".join(sorted(p.name for p in out_dir.iterdir())))

    run_stage("package_draft", snakemake.log[0], body)
