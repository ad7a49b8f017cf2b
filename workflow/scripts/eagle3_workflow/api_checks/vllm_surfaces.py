"""check_api's checks of vLLM's surfaces: the version, the extract_hidden_states method, the hidden-states connector
and the internals our CPU subclass and CPU server launcher use, the completion protocol, the render endpoint, the
target architectures vLLM can capture, the spec-decode metrics evaluate_draft reads. Each returns (found, passed);
run_api_checks (checks.py) turns them into rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
from typing import Any

from packaging.version import Version

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def _signature_has(func: Any, params: list[str]) -> tuple[str, bool]:
    signature = inspect.signature(func)
    names = list(signature.parameters)
    return f"{func.__qualname__}{signature}", all(p in names for p in params)


def check_vllm_version(low: str, high: str) -> tuple[str, bool]:
    import vllm

    found = vllm.__version__
    base = Version(Version(found).base_version)
    return found, Version(low) <= base < Version(high)


def check_speculative_method() -> tuple[str, bool]:
    import typing

    from vllm.config import speculative

    def flatten(tp: Any) -> list[str]:
        out: list[str] = []
        for arg in typing.get_args(tp):
            out += flatten(arg) if typing.get_args(arg) else [arg]
        return out

    methods = flatten(speculative.SpeculativeMethod)
    return (
        "extract_hidden_states in SpeculativeMethod" if "extract_hidden_states" in methods else f"methods: {methods}"
    ), "extract_hidden_states" in methods and "eagle3" in methods


def check_connector_registered(name: str) -> tuple[str, bool]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class_by_name(name)
    return f"{cls.__module__}.{cls.__qualname__}", True


def check_cpu_connector() -> tuple[str, bool]:
    """The CPU subclass imports and every parent internal it relies on still exists."""
    module = importlib.import_module(CONNECTOR_MODULE)
    parent = module.ExampleHiddenStatesConnector
    ours = importlib.import_module("eagle3_workflow.serving.cpu_hs_connector")
    source = inspect.getsource(parent)
    missing = []
    for attribute, kind in ours.INTERNALS_USED:
        if kind == "method":
            if not callable(getattr(parent, attribute, None)):
                missing.append(f"method {attribute}")
        elif f"self.{attribute}" not in source:
            missing.append(f"attribute {attribute}")
    if missing:
        return f"{parent.__qualname__} lacks {missing}", False
    return f"{len(ours.INTERNALS_USED)} internals present", True


def check_cpu_server_launcher() -> tuple[str, bool]:
    """The CPU server's launcher (its EngineCore forked: eagle3_workflow.serving.cpu_server) finds what it patches."""
    from eagle3_workflow.serving.cpu_server import patch_points

    return patch_points()


def check_overridden_method() -> tuple[str, bool]:
    module = importlib.import_module(CONNECTOR_MODULE)
    found, ok = _signature_has(module.ExampleHiddenStatesConnector._submit_async_write, ["self", "pending"])
    fields = [f.name for f in dataclasses.fields(module.PendingSave)]
    ok = ok and all(f in fields for f in ("req_id", "filename", "token_ids", "block_ids"))
    return f"{found}; PendingSave{fields}", ok


def check_extract_from_kv_cache() -> tuple[str, bool]:
    module = importlib.import_module(CONNECTOR_MODULE)
    return _signature_has(module.extract_from_kv_cache, ["kv_cache", "slot_mapping", "num_tokens"])


def check_render_endpoint() -> tuple[str, bool]:
    try:
        from vllm.entrypoints.launchers import cli_args
    except ModuleNotFoundError:
        # vLLM 0.26 (the GPU pin): no flag, the route is registered for every generating model
        from vllm.entrypoints.scale_out.render import api_router

        paths = {getattr(route, "path", "") for route in api_router.router.routes}
        ok = "/v1/chat/completions/render" in paths
        return ("always served (this vLLM has no --enable-scale-out)" if ok else f"routes {sorted(paths)}"), ok

    fields = {f.name for f in dataclasses.fields(cli_args.FrontendArgs)}
    return (
        "--enable-scale-out" if "enable_scale_out" in fields else "no enable_scale_out field"
    ), "enable_scale_out" in fields


def check_completion_protocol() -> tuple[str, bool]:
    from vllm.entrypoints.openai.completion import protocol

    request_fields = protocol.CompletionRequest.model_fields
    response_fields = protocol.CompletionResponse.model_fields
    ok = "return_token_ids" in request_fields and "kv_transfer_params" in response_fields
    return (
        f"return_token_ids={'return_token_ids' in request_fields}, kv_transfer_params="
        f"{'kv_transfer_params' in response_fields}",
        ok,
    )


# draft-model classes registered beside the targets (EAGLE, DFlash, ...): they capture nothing themselves
DRAFT_ARCHITECTURE = re.compile(r"eagle|draft|dflash", re.IGNORECASE)


# a target generates text: embedding, classification and bare-model classes are not targets
GENERATIVE_ARCHITECTURE = re.compile(r"(ForCausalLM|ForConditionalGeneration)$")


def eagle3_capable_architectures() -> list[str]:
    """Target architectures of the installed vLLM's registry whose class supports EAGLE-3 capture.

    vLLM's own supports_eagle3 on every registered class (about 400; ~35 s on a loaded 2-core machine, run
    only when the target's architecture fails). Draft-model classes are left out: they are not targets.
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    capable = []
    registry_log = logging.getLogger("vllm.model_executor.models.registry")
    level = registry_log.level
    registry_log.setLevel(logging.CRITICAL)  # classes needing extras absent here (vision) would log tracebacks
    try:
        for arch in sorted(ModelRegistry.get_supported_archs()):
            if DRAFT_ARCHITECTURE.search(arch) or not GENERATIVE_ARCHITECTURE.search(arch):
                continue
            model_cls = ModelRegistry._try_load_model_cls(arch)
            if model_cls is not None and supports_eagle3(model_cls):
                capable.append(arch)
    finally:
        registry_log.setLevel(level)
    return capable


def check_architecture(architecture: str, trust_remote_code: bool) -> tuple[str, bool]:
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    if architecture not in ModelRegistry.get_supported_archs():
        return f"{architecture} not in vLLM's model registry", False
    model_cls = ModelRegistry._try_load_model_cls(architecture)
    if model_cls is None:
        return f"{architecture} registered but its class failed to import", False
    ok = bool(supports_eagle3(model_cls))
    return f"{model_cls.__name__}: supports_eagle3={ok}", ok


def check_spec_decode_metrics() -> tuple[str, bool]:
    """evaluate_draft reads acceptance from these counters through LLM.get_metrics(); a rename would make it
    fail after two engine starts, so it is caught here."""
    from vllm import LLM
    from vllm.v1.spec_decode import metrics

    from eagle3_workflow.serving.engine import PER_POSITION_METRIC, SPEC_COUNTERS

    source = inspect.getsource(metrics)
    missing = [name for name in [*SPEC_COUNTERS, PER_POSITION_METRIC] if f'"{name}"' not in source]
    if not callable(getattr(LLM, "get_metrics", None)):
        missing.append("LLM.get_metrics")
    return (f"missing {missing}" if missing else f"{len(SPEC_COUNTERS) + 1} counters + LLM.get_metrics"), not missing
