"""What the stage hands the regeneration worker (RegenerationSpec) through runtime.worker; the worker's result is
the stats artefact itself (files.data_artefacts.RegenerationStats, written to data/regenerated.stats.json). Kept apart from
generate.py, which runs as ``__main__`` in the child."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import field_serializer

from eagle3_workflow.files.artefacts import Artefact
from eagle3_workflow.settings.stages import RegenerateResponsesStage
from eagle3_workflow.settings.views import as_config


class RegenerationSpec(Artefact):
    """data/.regenerated.spec.json: the target, the prompt files, where the conversations go, the stage's settings."""

    written_by: ClassVar[str] = "regenerate_responses"

    target: str
    prompt_files: list[str]
    output: str  # the ShareGPT JSONL
    settings: RegenerateResponsesStage

    @field_serializer("settings")
    def _config(self, settings: RegenerateResponsesStage) -> dict[str, Any]:
        # as the config gave them: a key the config left out stays out (the stats record the section as given)
        return as_config(settings)
