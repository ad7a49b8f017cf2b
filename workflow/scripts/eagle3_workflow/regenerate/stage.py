"""Stage `regenerate_responses`: the target answers the prompts itself (self-distillation).

A draft learns to predict the target's own continuations, so the best training data is the target's answers, not
somebody else's. Prompts come from files and/or from the target itself (Magpie); they are deduplicated, answered
with offline vLLM, and written as ShareGPT JSONL (what ``prepare_data`` reads) plus a small stats file.

This module is the parent side: the rule's adapter (``main``) runs ``python -m eagle3_workflow.regenerate.generate``
as a runtime.worker (a RegenerationSpec in, the stats back) and streams its output into the rule's log; the worker
dies with the stage, and a request must finish every ``vllm.stall_timeout_s`` once the engine is up.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.data_artefacts import RegenerationStats
from eagle3_workflow.regenerate.protocol import RegenerationSpec
from eagle3_workflow.runtime.worker import Job, Watch, WorkerFiles, run_worker
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import RegenerateResponsesStage
from eagle3_workflow.settings.views import stage_settings

OUTPUT_TAIL_LINES = 40


# Snakemake sets these to the job's `threads` for every job. torch takes MKL_NUM_THREADS over OMP_NUM_THREADS,
# so vLLM's CPU worker, which vLLM pins to the cores it binds (on a 2-core host: one core, the other reserved
# for the engine), ran 2 threads on that one core: measured here, 64 requests x 96 tokens took > 300 s instead
# of 9 s (30x slower or worse, spin-waiting). Without them vLLM sizes each worker's threads to its cores.
def subprocess_env(settings: RegenerateResponsesStage) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment
    from eagle3_workflow.serving.engine import cpu_engine_environment, cpu_engine_in_one_process, resolve_device

    # vLLM's CPU workers set their own torch threads from their core binding; cpu_threads is the engine's
    env = child_environment(vllm_on_cpu=True, cpu_threads=settings.vllm.cpu_threads,
                            eager=resolve_device(settings.vllm.device) == "cpu" and settings.vllm.enforce_eager)  # fmt: skip
    # TP > 1 on CPU: a worker per core list (refused here, with the fix, when the CPUs cannot give one)
    env |= cpu_engine_environment(settings.vllm.device, settings.extraction.tensor_parallel_size,
                                  settings.vllm.cpu_threads)  # fmt: skip
    if cpu_engine_in_one_process(settings.vllm.device, settings.extraction.tensor_parallel_size):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's `uni` executor: regeneration_engine_kwargs
    return env


def run_subprocess(
    target: Path,
    prompt_files: Sequence[Path],
    settings: RegenerateResponsesStage,
    logger: logging.Logger,
    *,
    output: Path,
    stats_path: Path,
) -> RegenerationStats:
    """Run the regeneration in the worker ``python -m eagle3_workflow.regenerate.generate``, every output line into
    `logger`; the conversations go to `output`, the stats (the worker's result) to `stats_path`. Its spec stays
    beside the conversations (``.regenerated.spec.json``): with the command in the log, a failure can be rerun."""
    # absolute paths: the spec means the same from any working directory (a person rerunning it by hand)
    spec = RegenerationSpec(target=str(Path(target).resolve()), prompt_files=[str(Path(p).resolve()) for p in prompt_files],
                            output=str(Path(output).resolve()), settings=settings)  # fmt: skip
    job = Job(
        name="the regeneration subprocess",
        env=subprocess_env(settings),
        watch=Watch(stall_timeout_s=settings.vllm.stall_timeout_s),
        on_line=lambda line: logger.info("| %s", line),
        tail_lines=OUTPUT_TAIL_LINES,
        failure_hint="A vLLM start-up failure usually means the vllm section (max_model_len, kv_cache_memory_bytes) "
        "does not fit the target or the machine",
    )
    files = WorkerFiles(spec=output.with_name(f".{output.stem}.spec.json"), result=stats_path)
    stats = run_worker("eagle3_workflow.regenerate.generate", spec, RegenerationStats, files=files, job=job).result
    if not output.exists():
        raise StageError(f"the regeneration subprocess succeeded but did not write {output}; this is a bug")
    return stats


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
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
