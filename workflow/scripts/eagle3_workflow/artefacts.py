"""The artefacts stages hand to each other: one pydantic model per JSON file, `write` (atomic) and `load` (checked).

A stage writes its artefact with ``write(path, Model(...))`` and the next stage (or the report, or the model card)
reads it with ``load(Model, path)``: a missing key, a value of the wrong type or a file that is not JSON fails
there, with one message that names the file, every bad field and the rule to rerun, instead of a ``KeyError``
(or a silent ``.get()`` default) three functions later. Keys a newer writer added are ignored. Field order is the
order in the file; every model's JSON is what the dataclasses it replaced wrote, key for key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eagle3_workflow.errors import StageError
from eagle3_workflow.files import write_text_atomic

MAX_LISTED_PROBLEMS = 8


class Artefact(BaseModel):
    """A JSON file this workflow writes; `written_by` names the rule that writes it (the fix when it is bad)."""

    model_config = ConfigDict(extra="ignore")

    written_by: ClassVar[str] = ""


A = TypeVar("A", bound=Artefact)


class ArtefactError(StageError):
    """An artefact is missing, unreadable, not JSON, or not what its model says."""


def _fix(model: type[Artefact]) -> str:
    if model.written_by:
        return f"Rerun the rule that writes it: snakemake --forcerun {model.written_by} (with the run's --configfile)"
    return "Rerun the stage that writes it."


def _problem(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(the whole file)"
    if error["type"] == "missing":
        return f"{where}: missing"
    found = repr(error["input"])
    found = found if len(found) <= 60 else found[:57] + "..."
    return f"{where}: {error['msg']} (found {found})"


def validation_problems(exc: ValidationError) -> str:
    """One short line per bad field (pydantic's loc and msg), the first few of them."""
    errors = exc.errors(include_url=False)
    lines = [f"  {_problem(e)}" for e in errors[:MAX_LISTED_PROBLEMS]]
    if len(errors) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(errors) - MAX_LISTED_PROBLEMS} more")
    return "\n".join(lines)


def load(model: type[A], path: str | Path) -> A:
    """Read and check one artefact; ArtefactError names the file, each bad field and the rule to rerun."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtefactError(f"cannot read {path} ({exc!r}). {_fix(model)}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ArtefactError(f"{path} is not JSON ({exc!r}; cut short?). {_fix(model)}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = validation_problems(exc)  # not chained: pydantic's own dump (with URLs) would bury these lines
        raise ArtefactError(f"{path} is not a valid {model.__name__}:\n{problems}\n{_fix(model)}") from None


def write(path: str | Path, artefact: Artefact, *, in_place_when_full: bool = False) -> None:
    """The one writer: JSON (indent 2, keys in field order), atomically, as readable as the umask allows.
    in_place_when_full: a status file's last word, written in place on a full disk (files.write_text_atomic)."""
    text = json.dumps(artefact.model_dump(), indent=2, default=str) + "\n"
    write_text_atomic(path, text, in_place_when_full=in_place_when_full)


# --------------------------------------------------------------------------------------------- gates: check_api


class CheckRow(Artefact):
    """One line of a gate's table."""

    name: str
    expected: str
    found: str
    passed: bool
    detail: str = ""


class TargetInfo(Artefact):
    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


class ApiCompatReport(Artefact):
    """checks/api_compat.json."""

    written_by: ClassVar[str] = "check_api"

    passed: bool
    vllm_version: str
    speculators_version: str
    transformers_version: str
    torch_version: str
    device: str
    layer_ids: list[int]
    checks: list[CheckRow]
    target: TargetInfo


# ----------------------------------------------------------------------------- target: build record, sanity check


class GreedyAnswer(Artefact):
    question: str
    answer: str
    expected: str
    passed: bool


BUILD_RECORD = "eagle3_build.json"  # SmolLM2Build's file in the target folder: written by the build, read by the card


class SmolLM2Build(Artefact):
    """<target>/eagle3_build.json (BUILD_RECORD), beside the weights of a target built from the SmolLM2 GGUF."""

    written_by: ClassVar[str] = "build_smollm2_target"

    source: dict[str, Any]  # the GGUF: path, sha256, package version
    dtype: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    tensors_checked: int
    max_relative_weight_error: float
    greedy: GreedyAnswer
    convert_s: float
    verify_s: float


class SanityAnswer(Artefact):
    prompt: str
    answer: str
    finish_reason: str | None
    problem: str | None  # None when the answer is usable


class TargetSanityReport(Artefact):
    """checks/target_sanity.json."""

    written_by: ClassVar[str] = "check_target"

    passed: bool
    target: str
    max_tokens: int
    stop_token_ids: list[int]
    answers: list[SanityAnswer]


# ------------------------------------------------------------------------------------- data: regenerate, prepare


class RegenerationStats(Artefact):
    """data/regenerated.stats.json, beside regenerated.jsonl: where every prompt went."""

    written_by: ClassVar[str] = "regenerate_responses"

    target: str
    prompts_read: dict[str, int]  # per prompt file
    magpie_requested: int
    magpie_generated: int  # kept after the filters
    magpie_dropped: dict[str, int]  # empty | unfinished | too_short
    magpie_prefix: str | None  # the unsteered set's (None without one)
    duplicates_dropped: int
    capped_by_max_prompts: int
    too_long_dropped: int
    answers_generated: int
    empty_answers_dropped: int
    truncated_answers: int  # kept, but cut at regenerate.max_tokens
    conversations_written: int
    prompt_tokens: int
    generated_tokens: int
    engine_ready_s: float
    generate_s: float
    generated_tokens_per_s: float
    settings: dict[str, Any]
    stop_token_ids: list[int] = Field(default_factory=list)  # where answers end (eos + end-of-turn)
    stop_strings: list[str] = Field(default_factory=list)
    # per Magpie set (`magpie`, `magpie[<name>]` of regenerate.magpie_steered): requested, kept, dropped, prefix,
    # system_prompt; the totals above sum them
    magpie_sets: dict[str, dict[str, Any]] = Field(default_factory=dict)


class DataManifest(Artefact):
    """data/manifest.json."""

    written_by: ClassVar[str] = "prepare_data"

    records_read: int
    records_kept: int
    dropped: dict[str, int]
    truncated: int
    total_tokens: int
    assistant_tokens: int
    length_percentiles: dict[str, float]
    sources: list[str]
    max_seq_len: int
    prepared_dir: str
    token_freq_path: str


# ---------------------------------------------------------------------------------------------- gates: canary


class LayerMatch(Artefact):
    """One captured id: the reference layer nearest to its slot (of all 0..K and post-norm), the runner-up, the
    relative distances and their ratio (margin); the `layer-id convention` row fails when best != the id."""

    claimed: int
    best: str
    best_rel: float
    runner_up: str
    runner_up_rel: float
    own_rel: float
    margin: float


class CanaryReport(Artefact):
    """checks/canary.json."""

    written_by: ClassVar[str] = "canary"

    passed: bool
    device: str
    canary_layers: int
    canary_layer_ids: list[int]
    # which proof ran (canary.reference): hf_fp32 = every slot matched against the fp32 reference of every layer and
    # within tolerance of its own; self_consistency = only two extractions bit-identical (weaker: asked for)
    proof: Literal["hf_fp32", "self_consistency"]
    reference: str
    tolerance: float
    per_layer_max_rel_error: dict[str, float]
    per_layer_mean_rel_error: dict[str, float]
    # MoE targets (layer_match): tokens routed near a tie upstream, and those of them excused from the max error
    per_layer_ambiguous_tokens: dict[str, int] = Field(default_factory=dict)
    per_layer_excused_tokens: dict[str, int] = Field(default_factory=dict)
    samples: int
    server_ready_s: float
    checks: list[CheckRow]
    layer_matches: dict[str, LayerMatch] = Field(default_factory=dict)  # by captured id


# -------------------------------------------------------------------------------------- extraction, validation


class GreedyProbe(Artefact):
    """The server's greedy next token after one sample (token ids as strings in top_logprobs, as vLLM says them)."""

    row: int
    token_id: int
    top_logprobs: dict[str, float]


class ExtractionManifest(Artefact):
    """hidden_states/replica_<r>.json."""

    written_by: ClassVar[str] = "extract_hidden_states"

    replica: int
    replicas: int
    samples_total: int
    samples_extracted: int
    samples_reused: int
    tokens: int
    bytes_written: int
    wall_s: float
    server_ready_s: float
    tokens_per_s: float
    files_dir: str
    rows: list[int]
    # the server's greedy next token (+ top logprobs) after a few samples; validate_hidden_states recomputes it
    # from the captured last state through the target's final norm and lm_head
    greedy_probes: list[GreedyProbe] = Field(default_factory=list)


class ProgressSnapshot(Artefact):
    """hidden_states/progress_replica_<r>.json, rewritten every few seconds while a replica runs."""

    written_by: ClassVar[str] = "extract_hidden_states"

    # the last state is one of done, failed, stalled (server alive, no sample finished), stopped (a stop signal)
    state: Literal["starting", "running", "done", "failed", "stalled", "stopped"]
    replica: int
    samples_done: int
    samples_total: int
    tokens_done: int
    tokens_per_s: float
    eta_s: float | None
    updated_unix: float
    message: str = ""


class GreedyCheck(Artefact):
    """One probe recomputed from the captured id N through the target's final norm and lm_head."""

    row: int
    server_token: int
    recomputed_token: int
    logit_gap: float
    tolerance: float
    ok: bool


class DepthSlot(LayerMatch):
    """One captured id of the full-depth check: its nearest layer of the whole target (LayerMatch's fields), its
    largest error against its own layer (max |slot - own| / max |own|, per sample, the worst sample) and the verdict."""

    max_rel_error: float  # over the tokens not excused (layer_match: a near-tied MoE routing)
    ok: bool
    problem: str  # "" when ok; else why, in the words of the failure table
    tokens: int = 0  # tokens compared (all samples)
    ambiguous_tokens: int = 0  # routed within bf16 reach of a tie at an MoE layer before this id (0: dense)
    excused_tokens: int = 0  # ambiguous AND above the tolerance: left out of max_rel_error


class FullDepthReport(Artefact):
    """validate_hidden_states' full-depth check: every captured id of a few extracted samples against an fp32
    reference of the whole target, streamed from its checkpoint one decoder layer at a time."""

    enabled: bool  # false: validation.full_depth_check was turned off (unsafe), nothing below was checked
    passed: bool | None  # None when not enabled
    reference: str
    proof: str = "hf_fp32"  # which proof ran: hf_fp32 (every slot vs the fp32 reference), or none (turned off)
    num_layers: int
    layer_ids: list[int]
    rows: list[int]  # the samples compared: the longest and the shortest
    tokens: list[int]  # tokens compared per row (a prefix of at most max_tokens_per_sample)
    max_tokens_per_sample: int
    tolerance: float
    slots: list[DepthSlot]
    largest_layer_bytes: int  # the most weight bytes (fp32) held at once: one decoder layer, or the embedding
    wall_s: float
    note: str = ""


class ValidationReport(Artefact):
    """hidden_states/validation.json."""

    written_by: ClassVar[str] = "validate_hidden_states"

    passed: bool
    samples_expected: int
    samples_valid: int
    missing: list[int]
    bad: dict[str, str]
    tokens: int
    bytes: int
    layer_count: int
    hidden_size: int
    files_dir: list[str]
    greedy_check: list[GreedyCheck] = Field(default_factory=list)
    full_depth: FullDepthReport | None = None  # None: written before the check existed


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
