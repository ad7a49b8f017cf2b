"""Stage `check_api`: every vLLM / speculators / transformers surface the workflow touches, checked in the
environment that will run vLLM, before any model is loaded.

Each check is a row (name, expected, found, pass). A check that raises becomes a FAIL row carrying repr() of
the error, so one broken surface never hides the others. Any FAIL: a table in the log, non-zero exit and no
api_compat.json, so the canary and extraction (which take it as input) never start.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import logging
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_workflow.api_checks.vllm_surfaces import (
    check_architecture,
    check_completion_protocol,
    check_connector_registered,
    check_cpu_connector,
    check_cpu_server_launcher,
    check_extract_from_kv_cache,
    check_overridden_method,
    check_render_endpoint,
    check_spec_decode_metrics,
    check_speculative_method,
    check_vllm_version,
)
from eagle3_workflow.files.artefacts import CheckRow
from eagle3_workflow.files.hidden_states import resolve_layer_ids
from eagle3_workflow.files.target_artefacts import ApiCompatReport, TargetInfo
from eagle3_workflow.reference.target_config import read_target_config
from eagle3_workflow.trainer.command import TRAINER_FIELDS_USED

log = logging.getLogger("eagle3.check_api")


def _row(name: str, expected: str, check: Callable[[], tuple[str, bool]]) -> CheckRow:
    try:
        found, passed = check()
    except Exception as exc:  # noqa: BLE001 - a broken surface is a FAIL row with its cause, never a crash
        return CheckRow(name=name, expected=expected, found=f"error: {exc!r}", passed=False)
    return CheckRow(name=name, expected=expected, found=found, passed=passed)


def check_layer_ids(num_layers: int, configured: Sequence[int] | None) -> tuple[str, bool]:
    try:
        ids = resolve_layer_ids(num_layers, configured)
    except ValueError as exc:  # a config mistake: its own words, not an "error:" repr of an internal failure
        return str(exc), False
    return f"{ids} of {num_layers} layers", True


def check_trainer_fields(fields_used: list[str]) -> tuple[str, bool]:
    from speculators.train.config.schema import TrainConfig

    known: set[str] = set()
    for name, field in TrainConfig.model_fields.items():
        known.add(name)
        annotation = field.annotation
        if inspect.isclass(annotation) and hasattr(annotation, "model_fields"):
            known |= set(annotation.model_fields)
    missing = [f for f in fields_used if f not in known]
    return (f"missing {missing}" if missing else f"{len(fields_used)} fields present"), not missing


def check_trainer_shim() -> tuple[str, bool]:
    shim = importlib.import_module("eagle3_workflow.trainer.cpu_shim")
    results = shim.shim_patch_points_present()
    missing = [f"{name} ({detail})" for name, ok, detail in results if not ok]
    return (f"missing {missing}" if missing else f"{len(results)} patch points present"), not missing


def check_interrupt_patches() -> tuple[str, bool]:
    """The speculators trainer symbols the trainer entry wraps so that a stop signal's save can be resumed from."""
    interrupt = importlib.import_module("eagle3_workflow.trainer.interrupt")
    results = interrupt.interrupt_patch_points_present()
    missing = [f"{name} ({detail})" for name, ok, detail in results if not ok]
    return (f"missing {missing}" if missing else f"{len(results)} patch points present"), not missing


def check_speculators_model() -> tuple[str, bool]:
    from hs_connectors import FileTransfer
    from speculators.models.eagle3 import Eagle3DraftModel

    return f"{Eagle3DraftModel.__name__}, {FileTransfer.__name__}", True


def check_chat_template(target_dir: str, prepared_dir: str | None, trust_remote_code: bool) -> tuple[str, bool]:
    """apply_chat_template(tokenize=False) returns a str and re-preparing stored rows gives the same ids."""
    from transformers import AutoTokenizer

    from eagle3_workflow.files.chat import render, tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template", False
    text = render(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    if prepared_dir is None:
        return f"renders a {len(text)}-char prompt", True
    from eagle3_workflow.files.prepared import open_prepared

    dataset = open_prepared(prepared_dir)
    rows = min(3, len(dataset))
    for i in range(rows):
        messages = json.loads(dataset[i]["messages"])
        again = tokenize_conversation(tokenizer, messages).input_ids
        stored = list(dataset[i]["input_ids"])
        if again[: len(stored)] != stored:
            return f"row {i}: re-tokenizing gives different ids than prepare_data stored", False
    return f"{rows} prepared rows reproduce", True


# What a failed row means for the person reading it: a config key to change, the target they brought, or a
# package of the environment (and which one). Keyed by row name.
ROW_FIXES: dict[str, tuple[str, str]] = {
    "vllm version": ("environment", "vllm: install the version envs/ pins"),
    "speculative method extract_hidden_states": ("environment", "vllm: install the version envs/ pins"),
    "hidden-states connector": ("environment", "vllm: install the version envs/ pins"),
    "connector write hook signature": ("environment", "vllm: install the version envs/ pins"),
    "extract_from_kv_cache signature": ("environment", "vllm: install the version envs/ pins"),
    "completion protocol": ("environment", "vllm: install the version envs/ pins"),
    "render endpoint": ("environment", "vllm: install the version envs/ pins"),
    "spec-decode metrics": ("environment", "vllm: install the version envs/ pins"),
    "CPU connector internals": ("environment", "vllm (CPU build): install the version envs/cpu.yaml pins"),
    "CPU server launcher patch points": ("environment", "vllm (CPU build): install the version envs/cpu.yaml pins"),
    "speculators model + transfer": ("environment", "speculators: install the version envs/ pins"),
    "speculators train fields": ("environment", "speculators: install the version envs/ pins"),
    "CPU trainer shim patch points": ("environment", "speculators: install the version envs/cpu.yaml pins"),
    "trainer interrupt patch points": ("environment", "speculators: install the version envs/ pins"),
    "layer ids": ("config", "change hidden_states.layer_ids"),
    "target architecture": (
        "target",
        "this vLLM cannot capture hidden states of this architecture; use a target whose architecture is "
        "listed, or a vLLM that adds SupportsEagle3 to its model class",
    ),
    "full-depth reference": (
        "target",
        "validate_hidden_states compares every captured id with an fp32 reference of the whole target, which "
        "transformers must build and load; use a checkpoint whose architecture transformers knows, stored plain or "
        "in a compressed-tensors format the reference reads (the row names them), or set "
        "validation.full_depth_check: false (unsafe: ids past the canary's slice are then never proven)",
    ),
    "canary reference": (
        "target",
        "the canary compares every captured slot with transformers' fp32 forward of its slice (the full-depth "
        "check's streamed reference), which transformers must build and load; use a checkpoint whose architecture "
        "and weight format it reads, or set canary.reference: self_consistency (weaker: two extractions must only "
        "be bit-identical; recorded in canary.json's proof)",
    ),
    "chat template": (
        "target",
        "give target.path a tokenizer with a chat template (tokenizer_config.json or chat_template.jinja); "
        "if it has one, transformers differs from the version envs/ pins",
    ),
}
FIX_HEADINGS = {
    "config": "Config (change the key named)",
    "target": "Target model (target.path)",
    "environment": "Environment (install the pinned package named; envs/ lists the verified versions)",
}


def check_full_depth_reference(target_dir: str, trust_remote_code: bool, enabled: bool) -> tuple[str, bool]:
    """validate_hidden_states' full-depth reference can run this target (checked now, not after extraction)."""
    from eagle3_workflow.reference.full_depth import UnsupportedTarget, preflight

    if not enabled:
        return "not checked: validation.full_depth_check is false (unsafe)", True
    try:
        return preflight(Path(target_dir), trust_remote_code=trust_remote_code), True
    except UnsupportedTarget as exc:
        return exc.reason, False


def check_canary_reference(target_dir: str, trust_remote_code: bool, proof: str) -> tuple[str, bool]:
    """The canary's fp32 reference (the same streamed reference) can run this target, unless the config asked for the
    weaker self-consistency proof: never a silent fallback at the canary."""
    from eagle3_workflow.reference.full_depth import UnsupportedTarget, preflight

    if proof == "self_consistency":
        return "not checked: canary.reference is self_consistency (weaker: two extractions bit-identical)", True
    try:
        return preflight(Path(target_dir), trust_remote_code=trust_remote_code), True
    except UnsupportedTarget as exc:
        return exc.reason, False


def failure_advice(failed: list[CheckRow], capable_architectures: list[str] | None = None) -> str:
    """The failed rows grouped by who fixes them, each with its fix. Pure.

    `capable_architectures`: what this vLLM can capture, listed under a failed architecture row.
    """
    groups: dict[str, list[str]] = {kind: [] for kind in FIX_HEADINGS}
    for row in failed:
        kind, fix = ROW_FIXES.get(row.name, ("environment", "update the adapted code and its check"))
        if row.name == "target architecture" and capable_architectures:
            listed = textwrap.fill(
                ", ".join(capable_architectures), 110, initial_indent="    ", subsequent_indent="    "
            )
            fix += f"; this vLLM can capture these {len(capable_architectures)}:\n{listed}"
        groups[kind].append(f"- {row.name}: {row.found}\n  fix: {fix}")
    return "\n".join(f"{FIX_HEADINGS[kind]}:\n" + "\n".join(lines) for kind, lines in groups.items() if lines)


def run_api_checks(
    *,
    target_dir: str,
    prepared_dir: str | None,
    configured_layer_ids: Sequence[int] | None,
    vllm_min: str,
    vllm_max_exclusive: str,
    device: str,
    trust_remote_code: bool,
    trainer_fields: list[str] | None = None,
    need_render_endpoint: bool = True,
    full_depth_check: bool,
    canary_reference: str = "hf_fp32",
) -> ApiCompatReport:
    """All rows; pure apart from imports. The report's `passed` is the AND of the rows."""
    target = read_target_config(target_dir).info()
    rows = [
        *_environment_rows(vllm_min, vllm_max_exclusive),
        *_target_rows(target, target_dir, prepared_dir, configured_layer_ids, trust_remote_code),
        *_trainer_rows(trainer_fields or TRAINER_FIELDS_USED),
        *_reference_rows(target_dir, trust_remote_code, full_depth_check, canary_reference),
        *_serving_rows(device, need_render_endpoint),
    ]
    try:
        layer_ids = resolve_layer_ids(target.num_layers, configured_layer_ids)
    except ValueError:
        layer_ids = list(configured_layer_ids or [])
    import vllm

    return ApiCompatReport(
        passed=all(r.passed for r in rows),
        vllm_version=getattr(vllm, "__version__", "unknown"),
        speculators_version=_installed_version("speculators"),
        transformers_version=_installed_version("transformers"),
        torch_version=_installed_version("torch"),
        device=device,
        layer_ids=layer_ids,
        checks=rows,
        target=target,
    )


def _trainer_rows(fields: list[str]) -> list[CheckRow]:
    """What train_draft's trainer needs of speculators, on every device."""
    return [
        _row(
            "speculators train fields",
            "TrainConfig has every flag the rule passes",
            lambda: check_trainer_fields(fields),
        ),
        _row(
            "trainer interrupt patch points",
            "the trainer symbols that make a stop signal's save resumable exist",
            check_interrupt_patches,
        ),
    ]


def _reference_rows(target_dir: str, trust_remote_code: bool, full_depth: bool, canary: str) -> list[CheckRow]:
    """Whether the fp32 references of the gates can be built for this target (validate's, the canary's)."""
    return [
        _row(
            "full-depth reference",
            "transformers builds the decoder; the checkpoint has every layer, its quantization (if any) is read",
            lambda: check_full_depth_reference(target_dir, trust_remote_code, full_depth),
        ),
        _row(
            "canary reference",
            f"canary.reference {canary}: transformers builds the decoder; the checkpoint has every layer",
            lambda: check_canary_reference(target_dir, trust_remote_code, canary),
        ),
    ]


def _serving_rows(device: str, need_render_endpoint: bool) -> list[CheckRow]:
    """What the run's device needs: the canary's render endpoint, and on CPU the internals our CPU code patches."""
    rows = []
    if need_render_endpoint:
        rows.append(_row("render endpoint", "--enable-scale-out available", check_render_endpoint))
    if device == "cpu":
        rows += [
            _row("CPU connector internals", "parent internals the CPU subclass uses", check_cpu_connector),
            _row(
                "CPU server launcher patch points",
                "what eagle3_workflow.serving.cpu_server patches exists",
                check_cpu_server_launcher,
            ),
            _row("CPU trainer shim patch points", "every patched speculators symbol exists", check_trainer_shim),
        ]
    return rows


def _installed_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _environment_rows(vllm_min: str, vllm_max_exclusive: str) -> list[CheckRow]:
    """What the installed vLLM and speculators must offer, whatever the target."""
    return [
        _row(
            "vllm version",
            f">= {vllm_min}, < {vllm_max_exclusive}",
            lambda: check_vllm_version(vllm_min, vllm_max_exclusive),
        ),
        _row("speculative method extract_hidden_states", "accepted by vllm.config", check_speculative_method),
        _row(
            "hidden-states connector",
            "ExampleHiddenStatesConnector registered",
            lambda: check_connector_registered("ExampleHiddenStatesConnector"),
        ),
        _row("connector write hook signature", "_submit_async_write(self, pending)", check_overridden_method),
        _row("extract_from_kv_cache signature", "(kv_cache, slot_mapping, num_tokens)", check_extract_from_kv_cache),
        _row("completion protocol", "return_token_ids + kv_transfer_params", check_completion_protocol),
        _row("speculators model + transfer", "Eagle3DraftModel, FileTransfer", check_speculators_model),
        _row("spec-decode metrics", "acceptance counters evaluate_draft reads", check_spec_decode_metrics),
    ]


def _target_rows(
    target: TargetInfo,
    target_dir: str,
    prepared_dir: str | None,
    configured_layer_ids: Sequence[int] | None,
    trust_remote_code: bool,
) -> list[CheckRow]:
    """What this target needs: its architecture captured, its layer ids valid, its chat template reproducing."""
    return [
        _row(
            "target architecture",
            f"{target.architecture} registered, supports EAGLE-3 capture",
            lambda: check_architecture(target.architecture, trust_remote_code),
        ),
        _row(
            "layer ids",
            f"within 1..{target.num_layers}, last = {target.num_layers}",
            lambda: check_layer_ids(target.num_layers, configured_layer_ids),
        ),
        _row(
            "chat template",
            "str from apply_chat_template; prepared ids reproduce",
            lambda: check_chat_template(target_dir, prepared_dir, trust_remote_code),
        ),
    ]


def trainer_fields_used() -> list[str]:
    """The speculators TrainConfig fields train_draft sets, offline and online (trainer_command builds its
    command line from the same code, so the list cannot drift)."""
    return list(TRAINER_FIELDS_USED)
