"""The artefacts of the draft: draft/training.json and the training fingerprint (train_draft), the evaluation's
report and its parts (evaluate_draft), provenance.json (package_draft). The base and `load`/`write`: files.artefacts."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from eagle3_workflow.files.artefacts import Artefact

# ------------------------------------------------------------------------------------------------------ training


class CheckpointInfo(Artefact):
    epoch: int
    local_step: int
    global_step: int
    path: str

    def ends_training(self, epochs: int) -> bool:
        """Saved at the end of the last epoch: the trainer has nothing left to do."""
        return self.epoch == epochs - 1 and self.local_step == 0


class OnlineTrainingStats(Artefact):
    """draft/training.json's `online`: what the trainer's own vLLM server did (train.hidden_states: online)."""

    server_ready_s: float  # the last launch's server start
    samples_checked: int  # generated, loaded and checked, every epoch and launch
    tokens_checked: int
    failed_samples: dict[str, str]  # row -> reason, skipped under train.online.max_failed_samples
    peak_files: int  # high-water mark of hidden-state files on disk at once (the last launch)
    peak_bytes: int


class TrainingSummary(Artefact):
    """draft/training.json: how the draft in draft/ was made."""

    written_by: ClassVar[str] = "train_draft"

    device: str
    processes: int
    command: list[str]
    attempts: int
    resumed_from: CheckpointInfo | None
    final_checkpoint: CheckpointInfo
    epochs: int
    steps: int
    wall_s: float  # this attempt, stage start to end
    target_layer_ids: list[int]
    draft_vocab_size: int
    vocab_mapping_sha256: dict[str, str]
    final_train_loss: float | None
    final_val_loss: float | None
    final_val_full_acc: list[float]
    hidden_states: Literal["offline", "online"]  # train.hidden_states: files on disk, or generated on demand
    online: OnlineTrainingStats | None  # online only

    def hidden_states_source(self) -> str:
        """Where the trainer's hidden states came from, in words (the report and the model card)."""
        if self.hidden_states == "offline":
            return "offline: files extracted to disk once, read every epoch"
        if self.online is None:  # a forced rerun published the trained checkpoint without starting the trainer
            return "online: generated on demand by the trainer's own vLLM server (this launch started none)"
        online = self.online
        failed = f", {len(online.failed_samples)} skipped after failing" if online.failed_samples else ""
        return (
            f"{self.hidden_states}: generated on demand by the trainer's own vLLM server, {online.samples_checked} "
            f"samples ({online.tokens_checked} tokens) checked as they arrived{failed}; at most {online.peak_files} "
            "files on disk at once"
        )


class TrainingFingerprint(Artefact):
    """train_work/fingerprint.json: what the checkpoints in train_work/ were made from. Every key counts (a key
    this version does not know means other inputs), so unknown keys are refused here, not ignored."""

    model_config = ConfigDict(extra="forbid")
    written_by: ClassVar[str] = "train_draft"

    settings: dict[str, Any]
    target_layer_ids: list[int]
    target_config_sha256: str | None
    target_weight_files: dict[str, int]
    prepared_sha256: dict[str, str]
    token_freq_sha256: str
    validation_sha256: str
    hidden_state_samples_sha256: dict[str, str]
    speculators_version: str


class UntrainedDraftInputs(BaseModel):
    """What decides the untrained baseline's bytes (evaluation/baseline.py): the builder, the seed, the trained draft
    (config, d2t/t2d, dtype) and the verifier (embed_tokens, lm_head, its path in the config), by fingerprint
    (evaluation/fingerprint.py), and the libraries that initialise the fresh weights."""

    model_config = ConfigDict(extra="forbid")

    builder: int
    seed: int
    trained_draft: str
    trained_draft_files: dict[str, str]
    target: str
    target_files: dict[str, str]
    torch_version: str
    transformers_version: str
    speculators_version: str


class UntrainedDraftRecipe(Artefact):
    """eval/work/untrained_draft/recipe.json: what the untrained baseline in that folder was built from and the
    fingerprint of the files the build wrote. Written last, atomically: a folder without it (a build cut short),
    with other inputs, or whose files changed since, is built again; else the draft is kept as it is, so its files'
    size:mtime, and with them the keys of its measured engines, stay the same."""

    model_config = ConfigDict(extra="forbid")
    written_by: ClassVar[str] = "evaluate_draft"

    inputs: UntrainedDraftInputs
    files: dict[str, str]
    description: str
    frozen_tensors_differing: list[str]


class DraftConfig(Artefact):
    """The keys of a speculators draft's config.json (draft/, written by speculators' save) this workflow checks;
    the rest of the file is speculators' business. Optional here so that a wrong value is reported as such."""

    written_by: ClassVar[str] = "train_draft"

    speculators_model_type: str
    draft_vocab_size: int | None = None
    eagle_aux_hidden_state_layer_ids: list[int] | None = None


# ---------------------------------------------------------------------------------------------------- evaluation


class LosslessMismatch(Artefact):
    """The first generated token where a speculative run's greedy output differs from its reference run (the
    untrained draft's or the one without speculation: AcceptanceReport.lossless_reference), one per prompt that
    differs. `expected` and `reference` name the reference run's side."""

    prompt_index: int
    origin: str
    position: int  # index into the generated tokens
    expected_token: int | None  # None: the run without speculation stopped here
    found_token: int | None  # None: the speculative run stopped here
    # logit(expected) - logit(found) in steps of the logits' dtype at that magnitude, in the reference run; and
    # logit(found) - logit(expected) in the speculative run. None: a token not in the top-k.
    reference_gap_steps: float | None
    candidate_gap_steps: float | None
    tie: bool  # both gaps within evaluate.lossless_tie_steps (never with 0: exact)
    context: str  # the generated text just before the divergence
    expected_text: str
    found_text: str


class Throughput(Artefact):
    """One engine's timing passes at one concurrency (production settings: CUDA graphs on a GPU)."""

    concurrency: int
    prompts: int
    generated_tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float | None  # over no speculation at the same concurrency; None for no speculation itself
    ms_per_step: float | None  # at concurrency 1: seconds per target forward (a verification step, or one token)


class AcceptanceResult(Artefact):
    """One draft served by vLLM on the evaluation prompts (greedy), from vLLM's spec-decode counters."""

    label: str  # trained | untrained
    draft_path: str
    mean_acceptance_length: float  # tokens per verification step incl. the bonus token = 1 + accepted / drafts
    per_position_acceptance: list[float]  # accepted at draft position i / drafts
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_s: float  # at the first evaluate.timing_concurrency
    accepted_per_position: list[int]
    draft_acceptance_rate: float  # accepted / draft tokens
    generated_tokens: int
    generate_s: float
    speedup: float  # tokens_per_s / tokens_per_s without speculation, same prompts, same process
    engine_start_s: float
    lossless: bool
    mismatches: list[LosslessMismatch]
    non_argmax_steps: list[str] = Field(default_factory=list)  # emitted tokens that are not the run's own argmax
    # the margin of the argmax check: the smallest gap, in steps of the logits' dtype, by which an emitted token of
    # this run (or of the reference runs) lies below its step's argmax; None: every emitted token is its argmax
    non_argmax_min_gap_steps: float | None = None
    # with the untrained draft as the reference (AcceptanceReport.lossless_reference): this run's first divergences
    # from the run without speculation, recorded and not judged (that run's steps have other batch shapes)
    no_speculation_divergences: list[LosslessMismatch] = Field(default_factory=list)
    # with no reference (lossless_reference none): the trained draft's first divergences from the untrained draft's
    # run, recorded and not judged
    untrained_divergences: list[LosslessMismatch] = Field(default_factory=list)
    # tokens/s at each evaluate.timing_concurrency (production settings); tokens_per_s and speedup are the first's
    throughput: list[Throughput] = Field(default_factory=list)
    # the prompts (indices) whose lossless pass the acceptance above counts; None: every evaluation prompt. With the
    # untrained draft as the lossless reference, the untrained draft's first evaluate.untrained_prompts
    acceptance_prompts: list[int] | None = None
    # with the untrained draft as the lossless reference: the prompts it generated beyond those, as the reference
    # where the trained draft's output differs from the run without speculation
    reference_prompts: list[int] = Field(default_factory=list)


class MeasurementProcess(Artefact):
    """One process that started vLLM engines for the evaluation (CPU: one for all; GPU: one per engine)."""

    runs: list[str]
    wall_s: float  # the whole process: vLLM import, engine starts, generation, teardown, waits for the lock
    vllm_import_s: float
    engine_start_s: dict[str, float]
    load_1m: float  # host load average when it ended (CPU timings on a shared host are noisy)
    # processes that ran at once (evaluate.concurrent_processes): seconds this one waited for the evaluation's lock,
    # "shared" (for another's timing pass to end) and "exclusive" (its timing pass, for the others' imports, engine
    # starts, lossless and timing passes to end); empty when the processes ran one after another
    lock_wait_s: dict[str, float] = Field(default_factory=dict)


class TrainServeConsistency(Artefact):
    """acceptance.json's `consistency`: the trained draft's served per-position acceptance against what its own
    final validation accuracy (speculators' full_acc_k, draft/training.json) predicts; the rule is
    eagle3_workflow.evaluation.consistency's."""

    predicted: list[float]  # final_val_full_acc per TTT step (empty: no training.json)
    served: list[float]  # per_position_acceptance of the trained draft
    ratio: list[float | None]  # served / predicted per position (None where predicted is 0)
    min_ratio: float  # evaluate.consistency_min_ratio
    min_predicted: float  # evaluate.consistency_min_predicted
    num_drafts: int
    verdict: Literal["passed", "failed", "not judged"]
    reason: str


class ParityDifference(Artefact):
    """The first served step where vLLM's draft did not propose what the trained draft proposes (beyond a tie)."""

    prompt_index: int
    step: int  # the engine step of that request (0: the prefill's token)
    generated_position: int  # generated tokens before the step
    proposal: int  # the first proposal (1-based) where the two differ
    predicted_accepted: int
    served_accepted: int
    predicted_token: int  # the reference's proposal there (a target id)
    predicted_text: str
    served: str  # what vLLM proposed there, as far as its acceptance tells
    gap_steps: float | None  # the reference's logit gap there, in steps of the served dtype (None: not in its vocab)
    tie_bound_steps: float | None  # what rounding alone may move that gap by (parity.tie_bound), in the same steps
    context: str


class DraftParity(Artefact):
    """acceptance.json's `parity`: the trained draft's served steps against the reference's prediction
    (eagle3_workflow.evaluation.parity)."""

    verdict: Literal["passed", "failed", "not judged", "off"]
    prompts: list[int]  # indices into the evaluation prompts
    steps_compared: int
    agreeing_steps: int
    ties_excused: int
    differing_steps: int
    proposals_compared: int = 0  # served proposals compared one by one (0: the engine did not show them)
    dtype: str
    roundings: list[int]  # per proposal: the served dtype's roundings in series (parity.roundings)
    tie_sigmas: float  # a near-tie: within this many standard deviations of the rounding model
    reference: str
    independent: bool  # the reference read the trainer's checkpoint, not the served folder
    first_difference: ParityDifference | None = None
    config_differences: list[str] = Field(default_factory=list)


class AcceptanceReport(Artefact):
    """eval/acceptance.json. Written only when every speculative run was lossless and its served acceptance is
    consistent with its validation accuracy (`consistency`)."""

    written_by: ClassVar[str] = "evaluate_draft"

    num_prompts: int
    prompt_source: str
    num_speculative_tokens: int
    max_tokens: int
    trained: AcceptanceResult
    untrained: AcceptanceResult
    no_speculation_tokens_per_s: float
    lossless: bool
    lossless_mismatches: int  # first divergences counted over both drafts (ties included)
    num_prompts_requested: int
    prompt_detail: str  # where the prompts came from (rows, file, package)
    device: str
    vllm_version: str
    no_speculation_generated_tokens: int
    no_speculation_generate_s: float
    no_speculation_engine_start_s: float
    lossless_numerics: str  # batch_invariant | production: the kernels of the lossless pass
    lossless_tie_steps: int  # 0 = exact (always with the untrained reference)
    lossless_criterion: str  # the criterion in words, as applied
    untrained_baseline: str  # how the untrained draft was built, and whether its frozen tensors match
    processes: list[MeasurementProcess]
    notes: list[str]
    stop_token_ids: list[int] = Field(default_factory=list)  # where answers ended (eos + end-of-turn)
    stop_strings: list[str] = Field(default_factory=list)
    no_speculation_throughput: list[Throughput] = Field(default_factory=list)
    logit_dtype: str = "bfloat16"
    consistency: TrainServeConsistency | None = None  # None: written before the check existed
    parity: DraftParity | None = None  # None: written before the check existed
    # what the trained draft's greedy output was compared with: untrained (the untrained draft's run, both
    # speculative lossless passes one prompt at a time) or no_speculation (evaluate.lossless_reference)
    lossless_reference: str = "no_speculation"


# ---------------------------------------------------------------------------------------------------- provenance


class Provenance(Artefact):
    """results/<run>/provenance.json."""

    written_by: ClassVar[str] = "record_provenance"

    run: str
    created_unix: float
    host: str
    platform: str
    python: str
    git_commit: str
    git_dirty: bool
    packages: dict[str, str]
    accelerators: list[str]
    config: dict[str, Any]
    # the tree id of the files that ran (provenance.collect.working_tree_id): names them when the commit does not
    # (uncommitted changes, or a copy whose .git is older than its files); "" in records from before 2026-12-07
    git_tree: str = ""
