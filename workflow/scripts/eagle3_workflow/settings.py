"""Typed, read-only views of the validated config: each stage's settings, and nothing it does not read.

A stage's model here is the one declaration of which config keys the stage reads. Its rule's ``params.settings``
are derived from it (common.smk's ``stage_params("<rule>")``, which is ``config_of(rule_settings_model(rule, config),
config)``: RULE_SETTINGS[rule], or ONLINE_RULE_SETTINGS[rule] where train.hidden_states is online):
the values of exactly the keys the model declares, so the rule reruns exactly when one of them changes. The stage
validates them back into the model (``stage_settings(CanaryStage, snakemake.params.settings)``) and reads
attributes: ``settings.train.lr``.

- **Keys, types and defaults live in the schema** (workflow/schemas/config.schema.yaml): no field here has a
  default, since the validated config always carries every key. The one exception is ``target.build``, which has
  no schema default and is absent when target.path is set.
- **One model per stage** (``<Rule>Stage``; ``RULE_SETTINGS`` maps rule names to them). A section that a stage
  reads in part has a smaller view (ExtractionStall is the 3 keys the canary reads). The larger view extends the
  smaller one, so each field is typed once and a larger view is accepted wherever the smaller one is expected.
- **frozen, extra="forbid"**: a view cannot be changed, and a key its stage does not declare is refused.
- tests/unit/test_settings.py checks every rule's settings against its stage model, every field against the
  schema (names, types, enums, null), and that no field has a default.

JSON Schema's ``number`` is ``Number`` (``int | float``): an int stays an int, so a value a stage records (the
regenerate section in regenerated.stats.json) is the value the config gave.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3_workflow.errors import StageError

Number = int | float
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"


class View(BaseModel):
    """A read-only view of validated config values."""

    model_config = ConfigDict(frozen=True, extra="forbid")


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


# --- one model per stage: the keys it reads, which its rule's params.settings carry (stage_params) ---------------


class BuildTinyTargetStage(View):
    target: TinyTarget


class BuildKimiK25TargetStage(View):
    target: KimiTarget


class BuildSmollm2TargetStage(View):
    target: TargetDtype


class PrepareDataStage(View):
    data: DataPreparation
    target: TargetTrust


class ServingStage(View):
    """A stage that serves the target with vLLM: how it loads the target, the vllm section, and the TP it uses
    (vllm_server.target_server_spec sizes the server from these)."""

    extraction: ExtractionParallel
    target: TargetLoad
    vllm: VllmSettings


class CheckTargetStage(ServingStage):
    target_check: TargetCheckQuestions


class RegenerateResponsesStage(ServingStage):
    regenerate: RegenerateSettings


class CanaryReference(View):
    """canary.reference as check_api reads it: whether the canary's fp32 reference must be buildable."""

    reference: Literal["hf_fp32", "self_consistency"]


class CheckApiStage(View):
    check_api: CheckApiSettings
    canary: CanaryReference
    hidden_states: HiddenStatesSettings
    validation: ValidationFullDepth
    target: TargetTrust
    vllm: VllmDevice


class CanaryStage(ServingStage):
    canary: CanarySettings
    extraction: ExtractionStall


class ExtractHiddenStatesStage(ServingStage):
    extraction: ExtractionClient


class ExtractHiddenStatesOnlineStage(ExtractHiddenStatesStage):
    """Online training: extraction covers the check set only."""

    train: HiddenStatesMode


class ValidateHiddenStatesStage(View):
    validation: ValidationSettings
    target: TargetTrust


class ValidateHiddenStatesOnlineStage(ValidateHiddenStatesStage):
    """Online training: validation covers the check set only."""

    train: HiddenStatesMode


class TrainDraftStage(View):
    train: TrainSettings
    target: TargetTrust


class TrainDraftOnlineStage(ServingStage):
    """Online training serves the target itself: the server the canary proved, sized by the vllm section and
    watched for stalls as extraction's server is."""

    extraction: ExtractionStall
    train: OnlineTrainSettings


class EvaluateDraftStage(View):
    evaluate: EvaluationSettings
    vllm: VllmSettings
    train: TrainDataRatio
    target: TargetLoad


class PackageDraftStage(View):
    """The sections the model card quotes from, and the run's name."""

    run: str
    target: TargetSettings
    regenerate: RegenerateSettings
    train: OnlineTrainSettings
    evaluate: EvaluateSettings
    vllm: VllmSettings


# rule -> its stage's settings (every rule with params.settings)
RULE_SETTINGS: dict[str, type[View]] = {
    "build_tiny_target": BuildTinyTargetStage,
    "build_smollm2_target": BuildSmollm2TargetStage,
    "build_kimi_k25_target": BuildKimiK25TargetStage,
    "prepare_data": PrepareDataStage,
    "check_target": CheckTargetStage,
    "regenerate_responses": RegenerateResponsesStage,
    "check_api": CheckApiStage,
    "canary": CanaryStage,
    "extract_hidden_states": ExtractHiddenStatesStage,
    "validate_hidden_states": ValidateHiddenStatesStage,
    "train_draft": TrainDraftStage,
    "evaluate_draft": EvaluateDraftStage,
    "package_draft": PackageDraftStage,
}

# rule -> its stage's settings when train.hidden_states is online (the rules whose work the mode changes). Offline
# they read nothing of train.online, so a change there reruns none of them.
ONLINE_RULE_SETTINGS: dict[str, type[View]] = {
    "extract_hidden_states": ExtractHiddenStatesOnlineStage,
    "validate_hidden_states": ValidateHiddenStatesOnlineStage,
    "train_draft": TrainDraftOnlineStage,
}


def trains_online(config: Mapping[str, Any]) -> bool:
    """Whether a validated config, or a rule's params.settings, say train.hidden_states: online."""
    train = config.get("train")
    return isinstance(train, Mapping) and train.get("hidden_states") == "online"


def rule_settings_model(rule: str, config: Mapping[str, Any]) -> type[View]:
    """The settings model of `rule` for this config (common.smk's stage_params) or these params.settings (the
    stage's adapter): the online variant where train.hidden_states is online."""
    if trains_online(config) and rule in ONLINE_RULE_SETTINGS:
        return ONLINE_RULE_SETTINGS[rule]
    return RULE_SETTINGS[rule]


def online_check_samples(settings: View) -> int | None:
    """train.online.check_samples of a stage's settings that train online (None: offline, every row on disk)."""
    train = getattr(settings, "train", None)
    mode = getattr(train, "hidden_states", "offline")
    return train.online.check_samples if mode == "online" else None  # type: ignore[union-attr]


StageModel = TypeVar("StageModel", bound=View)


def nested_view(annotation: Any) -> type[View] | None:
    """The view a field holds (X, or X | None), else None: its keys are read one by one."""
    candidates = (annotation, *typing.get_args(annotation))
    return next((t for t in candidates if isinstance(t, type) and issubclass(t, View)), None)


def config_of(model: type[View], config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the keys `model` declares, taken from `config` (a whole validated config, or the section a
    section view models): nested as in the config, keys sorted at every level, so that a rule's params (whose
    repr is the rerun trigger) do not depend on the order of the config file. A rule's params.settings are
    config_of(its stage's model, config). A key the model declares without a default must be in `config`."""
    picked: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if name not in config:
            if field.is_required():
                raise KeyError(f"{model.__name__} reads {name!r}, which the config does not have")
            continue  # target.build: absent when target.path is set
        view = nested_view(field.annotation)
        value = config[name]
        picked[name] = config_of(view, value) if view is not None and isinstance(value, Mapping) else value
    return _sorted(picked)


def stage_settings(model: type[StageModel], settings: Mapping[str, Any]) -> StageModel:
    """A rule's params.settings as its stage's model; a mismatch is a bug of the workflow, named with its fix."""
    try:
        return model.model_validate(settings)
    except ValidationError as exc:
        raise StageError(
            f"the rule's params.settings do not fit eagle3_workflow.settings.{model.__name__}: {exc!r}\n"
            "A rule's settings are stage_params(<its own name>) (workflow/rules/common.smk), the keys its model in "
            "RULE_SETTINGS declares: the rule must name itself, its stage must validate with that same model, and "
            "the model must follow the schema; tests/unit/test_settings.py checks all three."
        ) from exc


def with_schema_defaults(**sections: Any) -> dict[str, Any]:
    """A validated config that sets only `sections` (over a minimal run), every other key at the schema's default:
    settings for code that runs without a config file (benches, tests), from the one place defaults live."""
    from eagle3_workflow.config_errors import validate_config

    config: dict[str, Any] = {"run": "defaults", "target": {"path": "target"}, "data": {}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    validate_config(config, SCHEMA_PATH)
    return config


def view_of(model: type[StageModel], config: Mapping[str, Any]) -> StageModel:
    """`model` of the keys it declares in `config`, for code that has no rule (benches, tests). A stage uses
    stage_settings, which refuses a key it does not declare."""
    return model.model_validate(config_of(model, config))


def as_config(view: View) -> dict[str, Any]:
    """A view as the config dict it came from (config_of's shape): JSON values, keys sorted, and a key the config
    left out (target.build) left out."""
    return _sorted(view.model_dump(mode="json", exclude_unset=True))


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(item) for item in value]
    return value
