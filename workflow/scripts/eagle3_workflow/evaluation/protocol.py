"""What the stage and its measurement process exchange: spec.json (MeasurementSpec) and result.json
(MeasurementResult), artefacts written with artefacts.write and read with artefacts.load on either side. Kept
apart from measure.py, which runs as ``__main__`` in the child: classes defined there would be
``__main__.MeasurementSpec`` in the child and another class in the stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from eagle3_workflow.artefacts import Artefact

TOP_LOGPROBS = 5
LOG_PREFIX = "[eval-vllm] "
NO_SPECULATION = "no_speculation"


class MeasurementRun(Artefact):
    label: str
    speculative_config: dict[str, Any] | None  # None: no speculation (the reference)


def eagle3_run(label: str, draft: Path, num_speculative_tokens: int) -> MeasurementRun:
    config = {"method": "eagle3", "model": str(Path(draft).resolve()), "num_speculative_tokens": num_speculative_tokens}
    return MeasurementRun(label=label, speculative_config=config)


class MeasurementSpec(Artefact):
    """<work_dir>/measure_<i>.spec.json: what one measurement process runs."""

    written_by: ClassVar[str] = "evaluate_draft"

    engine: dict[str, Any]  # vllm.LLM keyword arguments shared by every run
    prompts: list[list[int]]
    max_tokens: int
    timing_repeats: int
    runs: list[MeasurementRun]
    top_logprobs: int = TOP_LOGPROBS
    stop_token_ids: list[int] = Field(default_factory=list)  # eos + the template's end-of-turn
    stop: list[str] = Field(default_factory=list)


class RunResult(Artefact):
    label: str
    engine_start_s: float
    generate_s: float  # the fastest measured pass
    generate_s_passes: list[float]
    generated_tokens: int
    outputs: list[list[int]]
    finish_reasons: list[str]
    logprobs: list[list[dict[int, float]]]  # per prompt, per generated token: top-k token -> logprob
    metrics_before: list[dict[str, Any]]
    metrics_after: list[dict[str, Any]]
    load_1m: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the fastest pass (0 when nothing was timed)."""
        return self.generated_tokens / self.generate_s if self.generate_s > 0 else 0.0


class MeasurementResult(Artefact):
    """<work_dir>/measure_<i>.result.json: what one measurement process measured."""

    written_by: ClassVar[str] = "evaluate_draft"

    vllm_version: str
    import_s: float
    runs: list[RunResult]
