"""Stage `regenerate_responses`: the target answers the prompts itself (self-distillation).

A draft learns to predict the target's own continuations, so the best training data is the target's answers, not
somebody else's. Prompts come from files and/or from the target itself (Magpie); they are deduplicated, answered
with offline vLLM, and written as ShareGPT JSONL (what ``prepare_data`` reads) plus a small stats file.

This module is the parent side: the rule's adapter (``main``) starts ``python -m eagle3_workflow.regenerate.generate``
as a runtime.ChildProcess and streams its output into the rule's log; the child dies with the stage, and a request
must finish every ``vllm.stall_timeout_s`` once the engine is up.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.errors import StageError
from eagle3_workflow.runtime.child import ChildProcess, ProgressWatch
from eagle3_workflow.settings import RegenerateResponsesStage, VllmSettings, as_config, stage_settings

OUTPUT_TAIL_LINES = 40


# Snakemake sets these to the job's `threads` for every job. torch takes MKL_NUM_THREADS over OMP_NUM_THREADS,
# so vLLM's CPU worker, which vLLM pins to the cores it binds (on a 2-core host: one core, the other reserved
# for the engine), ran 2 threads on that one core: measured here, 64 requests x 96 tokens took > 300 s instead
# of 9 s (30x slower or worse, spin-waiting). Without them vLLM sizes each worker's threads to its cores.
def subprocess_env(vllm: VllmSettings) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    # vLLM's CPU workers set their own torch threads from their core binding; cpu_threads is the engine's
    return child_environment(vllm_on_cpu=True, cpu_threads=vllm.cpu_threads)


def run_subprocess(
    target: Path,
    prompt_files: Sequence[Path],
    settings: RegenerateResponsesStage,
    logger: logging.Logger,
    *,
    output: Path,
    stats_path: Path,
) -> None:
    """Run the regeneration in `python -m eagle3_workflow.regenerate.generate`, every output line into `logger`; the
    conversations go to `output`, the stats to `stats_path`."""
    cmd = [
        sys.executable,
        "-m",
        "eagle3_workflow.regenerate.generate",
        "--target",
        str(target),
        "--output",
        str(output),
        "--stats",
        str(stats_path),
        "--config-json",
        json.dumps(as_config(settings)),
    ]
    for path in prompt_files:
        cmd += ["--prompt-file", str(path)]
    logger.info("running: %s", " ".join(cmd[:4] + ["..."]))
    child = ChildProcess(
        cmd,
        name="the regeneration subprocess",
        env=subprocess_env(settings.vllm),
        on_line=lambda line: logger.info("| %s", line),
        progress=ProgressWatch(floor_s=settings.vllm.stall_timeout_s),
        tail_lines=OUTPUT_TAIL_LINES,
    )
    with child:
        returncode = child.wait()
    if returncode != 0:
        raise StageError(
            child.failure_text(f"the regeneration subprocess exited with status {returncode}", where="above")
            + "\nA vLLM start-up failure usually means the vllm section (max_model_len, kv_cache_memory_bytes) "
            "does not fit the target or the machine"
        )
    missing = [str(p) for p in (output, stats_path) if not p.exists()]
    if missing:
        raise StageError(f"the regeneration subprocess succeeded but did not write {missing}; this is a bug")


def main(snakemake: Any) -> None:
    from eagle3_workflow.gpu_placement import holding_gpus
    from eagle3_workflow.runtime.stage import run_stage

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        run_subprocess(
            Path(snakemake.input.target),
            [Path(p) for p in snakemake.input.prompt_files],
            stage_settings(RegenerateResponsesStage, snakemake.params.settings),
            log,
            output=Path(snakemake.output.conversations),
            stats_path=Path(snakemake.output.stats),
        )

    run_stage("regenerate_responses", snakemake.log[0], body)
