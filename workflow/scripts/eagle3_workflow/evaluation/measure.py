"""The measurement process, the package's only ``-m`` entry: ``python -m eagle3_workflow.evaluation.measure
--spec spec.json --result result.json``. It starts each engine of the spec in turn (vllm.LLM, offline), warms it
up, times the greedy passes and reads vLLM's spec-decode counters before and after the first measured one; its
output goes to the stage's log with a ``[eval-vllm]`` prefix. Only this module imports vLLM, inside the functions,
so the stage process never does.

Greedy decoding (temperature 0); the top-5 logprobs of every generated token are requested in every run (the
same overhead for all) for the lossless check."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from eagle3_workflow.artefacts import load, write
from eagle3_workflow.evaluation.protocol import (
    LOG_PREFIX,
    MeasurementResult,
    MeasurementRun,
    MeasurementSpec,
    RunResult,
)
from eagle3_workflow.runtime.stage import describe_exception

WARMUP_TOKENS = 4


def _spec_metrics(llm: Any) -> list[dict[str, Any]]:
    snapshot = []
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            snapshot.append(
                {
                    "name": metric.name,
                    "labels": dict(metric.labels),
                    "value": getattr(metric, "value", None),
                    "values": list(getattr(metric, "values", []) or []),
                }
            )
    return snapshot


def _shutdown(llm: Any) -> None:
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def measured_sampling(spec: MeasurementSpec) -> dict[str, Any]:
    """SamplingParams of the measured passes: greedy, stopping at eos and the template's end-of-turn."""
    return {
        "temperature": 0.0,
        "max_tokens": spec.max_tokens,
        "logprobs": spec.top_logprobs,
        "stop_token_ids": list(spec.stop_token_ids) or None,
        "stop": list(spec.stop) or None,
    }


def measure(spec: MeasurementSpec) -> MeasurementResult:
    """Start each engine in turn, warm it up, generate greedily on every prompt, read its counters."""
    started = time.perf_counter()
    import vllm

    from eagle3_workflow.runtime.child import engine_progress_bar

    import_s = time.perf_counter() - started
    progress_bar = engine_progress_bar()  # one marker per finished request: the parent's stall watch
    print(f"{LOG_PREFIX}vllm {vllm.__version__} imported in {import_s:.1f} s", flush=True)
    results = [measure_run(spec, run, progress_bar) for run in spec.runs]
    return MeasurementResult(vllm_version=vllm.__version__, import_s=import_s, runs=results)


def measure_run(spec: MeasurementSpec, run: MeasurementRun, progress_bar: Any) -> RunResult:
    """One engine: start it, warm it up (excluded), time the measured passes; shut it down even on failure."""
    from vllm import LLM, SamplingParams

    from eagle3_workflow.runtime.child import BUSY_MARKER, IDLE_MARKER, print_marker

    kwargs = dict(spec.engine)
    if run.speculative_config:
        kwargs["speculative_config"] = dict(run.speculative_config)
    print_marker(IDLE_MARKER)  # loading an engine is bounded by evaluate.timeout_s, not the stall watch
    print(f"{LOG_PREFIX}{run.label}: starting the engine ({kwargs})", flush=True)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_start_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids in spec.prompts]
    try:
        print_marker(BUSY_MARKER)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=progress_bar)
        before = _spec_metrics(llm)
        outputs, after, passes = timed_passes(llm, prompts, SamplingParams(**measured_sampling(spec)),
                                              repeats=spec.timing_repeats, progress_bar=progress_bar)  # fmt: skip
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    return run_result(run.label, outputs, engine_start_s=engine_start_s, passes=passes, before=before, after=after)


def timed_passes(
    llm: Any, prompts: list[dict[str, Any]], sampling: Any, *, repeats: int, progress_bar: Any
) -> tuple[list[Any], list[dict[str, Any]], list[float]]:
    """The wall time of each measured pass; the outputs and counters of the first one only (the later passes
    only time, as the counters are cumulative)."""
    passes = []
    outputs = after = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        generated = llm.generate(prompts, sampling, use_tqdm=progress_bar)
        passes.append(time.perf_counter() - t0)
        if outputs is None:
            outputs = generated
            after = _spec_metrics(llm)
    assert outputs is not None and after is not None
    return outputs, after, passes


def run_result(
    label: str,
    outputs: list[Any],
    *,
    engine_start_s: float,
    passes: list[float],
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
) -> RunResult:
    """The RunResult of one engine from vLLM's RequestOutputs; its tokens/s line goes to the log."""
    completions = [request.outputs[0] for request in outputs]
    token_ids = [list(c.token_ids) for c in completions]
    generated_tokens = sum(len(ids) for ids in token_ids)
    print(
        f"{LOG_PREFIX}{label}: engine start {engine_start_s:.1f} s, {generated_tokens} tokens in "
        f"{min(passes):.2f} s ({generated_tokens / min(passes):.1f} tokens/s)",
        flush=True,
    )
    return RunResult(
        label=label,
        engine_start_s=engine_start_s,
        generate_s=min(passes),
        generate_s_passes=passes,
        generated_tokens=generated_tokens,
        outputs=token_ids,
        finish_reasons=[str(c.finish_reason) for c in completions],
        logprobs=[
            [{int(tok): float(lp.logprob) for tok, lp in step.items()} for step in (c.logprobs or [])]
            for c in completions
        ],
        metrics_before=before,
        metrics_after=after,
        load_1m=os.getloadavg()[0],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one evaluate_draft measurement process (vLLM offline engine)")
    parser.add_argument("--spec", required=True, help="MeasurementSpec JSON")
    parser.add_argument("--result", required=True, help="where to write the MeasurementResult JSON")
    args = parser.parse_args(argv)
    try:
        result = measure(load(MeasurementSpec, args.spec))
        write(args.result, result)
    except BaseException as exc:  # noqa: BLE001 - the parent quotes this from the log
        print(f"{LOG_PREFIX}measurement FAILED: {describe_exception(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
