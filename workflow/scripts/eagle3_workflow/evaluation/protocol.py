"""What the stage and its measurement process exchange: spec.json (MeasurementSpec) and result.json
(MeasurementResult), artefacts written with files.artefacts.write and read with files.artefacts.load on either side. Kept
apart from measure.py, which runs as ``__main__`` in the child: classes defined there would be
``__main__.MeasurementSpec`` in the child and another class in the stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from eagle3_workflow.files.artefacts import Artefact

TOP_LOGPROBS = 5
NO_SPECULATION = "no_speculation"


def log_prefix(process: str | None = None) -> str:
    """What goes before a measurement process's lines in the stage's log: "[eval-vllm] ", or with the process's
    name when several run at once ("[eval-vllm trained.timing] ")."""
    return f"[eval-vllm {process}] " if process else "[eval-vllm] "


LOG_PREFIX = log_prefix()


class MeasurementRun(Artefact):
    """One engine of a measurement process and the passes it runs.

    The lossless pass generates greedily on every prompt with the top-k raw logits of each step and reads the
    spec-decode counters around it (acceptance); the timing passes time the first `timing_prompts` prompts at each
    concurrency. `engine_overrides` are this engine's own vllm.LLM keyword arguments (eager or CUDA graphs,
    logprobs mode). The child writes the RunResult to `result_path` as soon as the engine is measured, so a rerun
    after a cut reuses every engine whose `key` (a hash of everything that decides its result) is unchanged."""

    label: str
    speculative_config: dict[str, Any] | None  # None: no speculation (the reference)
    lossless_pass: bool = True
    timing_pass: bool = True
    # the lossless pass generates each prompt alone (one request in flight), so every step of a speculative engine
    # verifies exactly 1 + k rows whatever its draft proposes or how soon its other requests end: two speculative
    # runs then put the same batch shapes through the verifier (plan.lossless_reference, docs/faults.md)
    lossless_alone: bool = False
    # the prompts (indices into the spec's, in this order) the lossless pass generates; None: every prompt. The
    # untrained draft as the CPU reference generates only a few (measurements.measure_untrained_reference)
    lossless_prompts: list[int] | None = None
    engine_overrides: dict[str, Any] = Field(default_factory=dict)
    # the draft parity pass (evaluation/parity.py): the first N prompts one at a time, each engine step's tokens
    parity_prompts: int = 0
    key: str = ""
    result_path: str | None = None


def eagle3_run(label: str, draft: Path, num_speculative_tokens: int) -> MeasurementRun:
    """The run of an EAGLE-3 draft, named by its absolute path."""
    config = {"method": "eagle3", "model": str(Path(draft).resolve()), "num_speculative_tokens": num_speculative_tokens}
    return MeasurementRun(label=label, speculative_config=config)


class MeasurementSpec(Artefact):
    """<work_dir>/measure_<i>.spec.json: what one measurement process runs. Every path in it is absolute (the
    builders resolve them: measurement_engine_kwargs, eagle3_run, resume.keyed_run), so the spec means the same
    from any working directory."""

    written_by: ClassVar[str] = "evaluate_draft"

    engine: dict[str, Any]  # vllm.LLM keyword arguments shared by every run
    prompts: list[list[int]]
    max_tokens: int
    timing_repeats: int
    runs: list[MeasurementRun]
    top_logprobs: int = TOP_LOGPROBS
    stop_token_ids: list[int] = Field(default_factory=list)  # eos + the template's end-of-turn
    stop: list[str] = Field(default_factory=list)
    timing_concurrency: list[int] = Field(default_factory=lambda: [1])
    timing_prompts: int | None = None  # None: every prompt
    # vLLM's batch-invariant kernels for the whole process: the process sets VLLM_BATCH_INVARIANT before it imports
    # vLLM (vLLM reads it when it starts an engine and cannot switch back)
    batch_invariant: bool = False
    # processes measuring at once share this lock file (gate.Gate: shared to import, start and run lossless
    # passes, exclusive to time); None: the process runs alone and takes no lock
    lock_path: str | None = None
    # before each line the process prints (and the parent before each of its other lines): processes running at
    # once get one each, so their interleaved lines in the stage's log can be told apart
    log_prefix: str = LOG_PREFIX


class ConcurrencyTiming(Artefact):
    """The timing passes of one engine at one concurrency: the first `prompts` prompts, `concurrency` at a time
    (each batch waits for its slowest request, as a static batch does)."""

    concurrency: int
    prompts: int
    generated_tokens: int
    seconds: float  # the fastest pass
    seconds_passes: list[float]
    verify_steps: int | None = None  # drafts proposed in the first pass (speculative runs): target forward passes

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


class RunResult(Artefact):
    label: str
    engine_start_s: float
    # the lossless pass (empty lists when the run had none)
    generate_s: float
    generated_tokens: int
    outputs: list[list[int]]
    finish_reasons: list[str]
    top_logits: list[list[dict[int, float]]]  # per prompt, per generated token: top-k token -> raw logit
    metrics_before: list[dict[str, Any]]
    metrics_after: list[dict[str, Any]]
    load_1m: float
    timings: list[ConcurrencyTiming] = Field(default_factory=list)
    # the prompts the lossless pass generated (indices into the evaluation prompts; outputs, top_logits and
    # finish_reasons follow this order); None: every prompt, in order
    prompt_indices: list[int] | None = None
    # the parity pass: per prompt, the greedy output and the tokens each engine step emitted (accepted + 1)
    parity_outputs: list[list[int]] = Field(default_factory=list)
    parity_steps: list[list[int]] = Field(default_factory=list)
    # per prompt, per step: the draft's proposals made after that step (None: the engine does not show them)
    parity_proposals: list[list[list[int]]] | None = None
    key: str = ""
    numerics: str = "production"  # production | batch_invariant: the kernels the engine ran with

    def timing_at(self, concurrency: int) -> ConcurrencyTiming | None:
        return next((t for t in self.timings if t.concurrency == concurrency), None)


class MeasurementResult(Artefact):
    """<work_dir>/measure_<i>.result.json: what one measurement process measured."""

    written_by: ClassVar[str] = "evaluate_draft"

    vllm_version: str
    import_s: float
    runs: list[RunResult]
    # seconds spent waiting for the shared lock file, per mode (shared, exclusive); empty without one
    lock_wait_s: dict[str, float] = Field(default_factory=dict)
