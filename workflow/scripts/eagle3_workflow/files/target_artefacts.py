"""The artefacts of the target and the API: checks/api_compat.json (check_api), the target's build record
(build_smollm2_target), checks/target_sanity.json (check_target). The base and `load`/`write`: files.artefacts."""

from __future__ import annotations

from typing import Any, ClassVar

from eagle3_workflow.files.artefacts import Artefact, CheckRow


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
