"""The artefacts of the training data: data/regenerated.stats.json (regenerate_responses), data/manifest.json
(prepare_data), checks/canary.json (canary), the extraction manifest and progress (extract_hidden_states),
checks/validation.json (validate_hidden_states). The base and `load`/`write`: files.artefacts."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from eagle3_workflow.files.artefacts import Artefact, CheckRow

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
    reference_device: str = "cpu"  # reference.device: where the hf_fp32 reference's layers ran
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
    reference_device: str = "cpu"  # reference.device: where the fp32 layers ran (cpu, or cuda with TF32 off)
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
