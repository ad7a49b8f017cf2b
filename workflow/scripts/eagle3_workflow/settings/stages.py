"""One model per stage: the keys it reads, which its rule's params.settings carry (common.smk's stage_params):
RULE_SETTINGS, and ONLINE_RULE_SETTINGS where train.hidden_states is online (settings.views says how they are used)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from eagle3_workflow.settings.sections import (
    CanarySettings,
    CheckApiSettings,
    DataPreparation,
    EvaluateSettings,
    EvaluationSettings,
    ExtractionClient,
    ExtractionParallel,
    ExtractionStall,
    HiddenStatesMode,
    HiddenStatesSettings,
    KimiTarget,
    OnlineTrainSettings,
    ReferenceSettings,
    RegenerateSettings,
    TargetCheckQuestions,
    TargetDtype,
    TargetLoad,
    TargetSettings,
    TargetTrust,
    TinyTarget,
    TrainDataRatio,
    TrainSettings,
    ValidationFullDepth,
    ValidationSettings,
    VllmDevice,
    VllmSettings,
)
from eagle3_workflow.settings.views import View


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
    (serving.engine.target_server_spec sizes the server from these)."""

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
    reference: ReferenceSettings


class ExtractHiddenStatesStage(ServingStage):
    extraction: ExtractionClient


class ExtractHiddenStatesOnlineStage(ExtractHiddenStatesStage):
    """Online training: extraction covers the check set only."""

    train: HiddenStatesMode


class ValidateHiddenStatesStage(View):
    validation: ValidationSettings
    target: TargetTrust
    reference: ReferenceSettings


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
    reference: ReferenceSettings


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
