"""The `evaluate` config section as the stage reads it."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class EvaluationSettings:
    """The `evaluate` config section (schema defaults filled by Snakemake's validate())."""

    prompts: str = "heldout"
    prompt_file: str | None = None
    num_prompts: int = 32
    num_speculative_tokens: int = 3
    max_tokens: int = 128
    seed: int = 0
    tensor_parallel_size: int = 1
    isolate_runs: bool | None = None
    timing_repeats: int = 3
    lossless_logprob_tolerance: float = 0.0
    timeout_s: float = 7200.0

    @classmethod
    def from_config(cls, section: dict[str, Any]) -> EvaluationSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})
