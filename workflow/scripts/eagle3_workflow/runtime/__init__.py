"""How a stage runs as a process, and every process it starts.

Owns:
- ``stage``: logging to the rule's log, one failure format, one signal policy (run_stage, StageStopped);
- ``child``: ChildProcess, the one way to start, watch and stop a child (vLLM servers, engines, the trainer);
- ``launcher``: the child's direct parent that makes its whole tree die with the stage (stdlib only);
- ``worker``: a stage's work handed to a child process, spec in, typed result out (run_worker, serve);
- ``gpu_placement``: which GPUs a job of a local run takes, and the locks that keep two jobs off one GPU;
- this module: the environment of the processes stages start (child_environment, below).

May import: files, settings (docs/architecture.md). Nothing of serving, trainer or reference: they run through
runtime, not the other way round.

The environment of the processes stages start: vLLM servers and engines, the trainer. They need the shared package on their PYTHONPATH (the CPU connector and the trainer shim are imported by
name), unbuffered output (their log is streamed line by line) and no model hub. A CPU vLLM also needs the
thread limits Snakemake sets for every job removed: Snakemake exports MKL_NUM_THREADS=<threads>, torch prefers
it over OMP_NUM_THREADS, and vLLM pins its CPU worker to one core, so two torch threads fought over that core
(measured: a 64-request regeneration took over 300 s instead of 9 s).

An eager CPU vLLM (enforce_eager) compiles no model graph, but its sampler still wraps one helper in
torch.compile: the logprob rank (vllm/v1/sample/ops/logprobs.py, batched_count_greater_than, ``(x >= v).sum(-1)``),
run by every request that asks for logprobs (the extraction's greedy probe, the evaluation's lossless pass).
Through dynamo and inductor that is a C++ build with gcc the first time on a machine (measured: 15 s of a 30 s
extraction right after `make setup`) and ~1.6 CPU-s of tracing and cache loading in every later process.
``TORCHDYNAMO_DISABLE=1`` runs it as written, giving the same integer counts: set for eager CPU engines unless
the environment already says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parents[2]  # workflow/scripts (this file: eagle3_workflow/runtime/__init__.py)
INHERITED_THREAD_VARIABLES = (
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


def child_environment(
    *, vllm_on_cpu: bool = False, cpu_threads: int | None = None, eager: bool = False
) -> dict[str, str]:
    """The environment of a child process; `vllm_on_cpu` for a CPU vLLM engine (server or offline), `eager` when
    every engine it starts has enforce_eager (no torch.compile wanted there: see the module's docstring)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS_DIR), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if vllm_on_cpu:
        for name in INHERITED_THREAD_VARIABLES:
            env.pop(name, None)
        if cpu_threads:
            # vLLM reduces torch to one thread for serving unless OMP_NUM_THREADS is set
            env["OMP_NUM_THREADS"] = str(cpu_threads)
        # spinning OpenMP threads starve the API server and client on a small machine (one generate pass
        # swung from 0.2 s to 5 s under load); passive waiting costs nothing measurable on an idle machine
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if eager:
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
    return env
