"""The views of the config's sections (target, data, regenerate, vllm, extraction, validation, train, evaluate), each
as small as the stage that reads it needs: a larger view extends the smaller one (settings.views says why)."""

from __future__ import annotations

from typing import Literal

from eagle3_workflow.settings.views import Number, View

# --- target ------------------------------------------------------------------------------------------------------


class TargetTrust(View):
    """target.trust_remote_code: passed to transformers and vLLM only when true."""

    trust_remote_code: bool


class TargetDtype(View):
    dtype: Literal["bfloat16", "float16", "auto"]


class TargetLoad(TargetDtype, TargetTrust):
    """How a stage that serves the target loads it: dtype and trust_remote_code."""


class BuildShape(View):
    """The shape keys of target.build that every built random-weight target reads (tiny and kimi_k25)."""

    num_layers: int
    hidden_size: int
    head_dim: Literal[32, 64, 128]
    vocab_size: int
    seed: int


class TinyShape(BuildShape):
    """target.build as build_tiny_target reads it: the shape of a tiny target."""

    arch: Literal["llama", "qwen3", "deepseek_v3"]


class KimiShape(BuildShape):
    """target.build as build_kimi_k25_target reads it: the stand-in's shape and widths (None: derived from
    hidden_size), whether its experts are INT4, and how its weights are drawn."""

    quantization: Literal["none", "int4"]
    num_heads: int | None
    q_lora_rank: int | None
    intermediate_size: int | None
    moe_intermediate_size: int | None
    routed_experts: int
    experts_per_token: int
    padded_vocab_size: int | None
    weights: Literal["random", "trained_like"]


class TargetBuild(TinyShape, KimiShape):
    kind: Literal["tiny", "smollm2", "kimi_k25"]


class TinyTarget(View):
    """target as build_tiny_target reads it: only the shape."""

    build: TinyShape


class KimiTarget(View):
    """target as build_kimi_k25_target reads it: only the shape."""

    build: KimiShape


class TargetSettings(TargetLoad):
    """The whole target section."""

    path: str | None
    # the schema's only key without a default: a user's target.path leaves target.build out of the config
    build: TargetBuild | None = None


# --- data, regenerate, target_check ------------------------------------------------------------------------------


class DataPreparation(View):
    """data as prepare_data reads it (data.sources reaches it as the rule's inputs, with params.formats)."""

    max_seq_len: int
    overlength: Literal["truncate", "drop"]
    on_bad_record: Literal["fail", "skip"]
    max_samples: int | None
    min_assistant_tokens: int
    max_repeated_share: float | None
    seed: int


class MagpieSteer(View):
    """One item of regenerate.magpie_steered: a set of Magpie user turns written after a steering system message."""

    name: str
    prompts: int
    system_prompt: str


class RegenerateSettings(View):
    """The whole regenerate section."""

    enabled: bool
    prompt_files: tuple[str, ...]
    magpie_prompts: int
    magpie_steered: tuple[MagpieSteer, ...]
    magpie_max_tokens: int
    magpie_min_chars: int
    magpie_temperature: Number
    max_prompts: int | None
    max_tokens: int
    temperature: Number
    seed: int
    runtime_minutes: int


class TargetCheckQuestions(View):
    """target_check as check_target reads it (target_check.enabled decides, in the rules, whether it runs)."""

    max_tokens: int
    request_timeout_s: Number


# --- vllm, hidden_states, check_api, canary ----------------------------------------------------------------------


class VllmDevice(View):
    device: Literal["auto", "cpu", "cuda"]


class VllmSettings(VllmDevice):
    """The whole vllm section: every server and offline engine the workflow starts."""

    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    generation_cuda_graphs: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: Number
    ready_timeout_s: Number
    stall_timeout_s: Number
    cpu_threads: int | None
    extra_args: tuple[str, ...]


class HiddenStatesSettings(View):
    layer_ids: tuple[int, ...] | None


class CheckApiSettings(View):
    vllm_min: str
    vllm_max_exclusive: str


class CanarySettings(View):
    num_layers: int | None
    num_samples: int
    max_tokens_per_sample: int
    relative_tolerance: Number
    render_samples: int
    reference: Literal["hf_fp32", "self_consistency"]


# --- extraction, validation --------------------------------------------------------------------------------------


class ExtractionParallel(View):
    """extraction.tensor_parallel_size: how a stage that serves the target splits it (on CUDA)."""

    tensor_parallel_size: int


class ExtractionStall(ExtractionParallel):
    """extraction as the canary reads it: the server's TP and the client's stall limit."""

    stall_timeout_s: Number
    stall_factor: Number


class ExtractionClient(ExtractionStall):
    """extraction as extract_hidden_states reads it (gpus_per_replica and runtime_minutes are the rule's resources)."""

    replicas: int
    concurrency: int
    request_timeout_s: Number
    max_retries: int
    progress_interval_s: Number
    fail_after_samples: int | None
    disk_margin: Number
    available_bytes_override: int | None
    greedy_probe_samples: int


class ValidationFullDepth(View):
    """validation.full_depth_check: check_api proves early that the full-depth reference can run the target."""

    full_depth_check: bool


class ValidationSettings(ValidationFullDepth):
    max_bad_samples: int
    full_depth_max_tokens: int
    full_depth_relative_tolerance: Number


class ReferenceSettings(View):
    """reference.device: where the fp32 reference runs (canary, validation's full-depth proof, evaluation's parity)."""

    device: Literal["cpu", "cuda"]


# --- train, evaluate ---------------------------------------------------------------------------------------------


class TrainDataRatio(View):
    """train.train_data_ratio: where the trainer splits the prepared rows (evaluation's held-out prompts follow it)."""

    train_data_ratio: Number


class OnlineCheckSet(View):
    """train.online.check_samples: the rows extraction and validation cover in online mode."""

    check_samples: int


class OnlineTraining(OnlineCheckSet):
    """train.online: the online trainer's vLLM server and its sample policy."""

    server_gpus: int
    gpu_memory_utilization: Number
    request_timeout_s: Number
    generation_retries: int
    max_failed_samples: int
    requests_in_flight: int


class HiddenStatesMode(View):
    """train.hidden_states with the check set, as extraction and validation read it in online mode."""

    hidden_states: Literal["offline", "online"]
    online: OnlineCheckSet


class TrainSettings(TrainDataRatio):
    """The train section as offline training reads it (train.online is read only online: OnlineTrainSettings)."""

    gpus: int
    cpu_processes: int
    draft_layers: int
    ttt_steps: int
    draft_vocab_size: int
    lr: Number
    optimizer: Literal["adamw", "muon"]
    epochs: int
    total_seq_len: int
    num_workers: int
    seed: int
    checkpoint_freq: Number
    disk_margin: Number
    runtime_minutes: int
    extra_args: tuple[str, ...]
    hidden_states: Literal["offline", "online"]


class OnlineTrainSettings(TrainSettings):
    """The whole train section: online training reads train.online too."""

    online: OnlineTraining


class EvaluationSettings(View):
    """evaluate as evaluate_draft reads it (evaluate.gpus is the rule's resource)."""

    prompts: Literal["heldout", "humaneval", "file"]
    prompt_file: str | None
    num_prompts: int
    num_speculative_tokens: int
    max_tokens: int
    tensor_parallel_size: int
    seed: int
    isolate_runs: bool | None
    concurrent_processes: bool | None
    kv_cache_memory_bytes: int | None
    time_untrained: bool
    timing_repeats: int
    timing_concurrency: tuple[int, ...]
    timing_prompts: int
    lossless_numerics: Literal["auto", "batch_invariant", "production"]
    lossless_reference: Literal["auto", "untrained", "no_speculation", "none"]
    untrained_prompts: int
    lossless_tie_steps: int
    consistency_min_ratio: Number
    consistency_min_predicted: Number
    draft_parity_prompts: int
    timeout_s: Number


class EvaluateSettings(EvaluationSettings):
    """The whole evaluate section."""

    gpus: int
