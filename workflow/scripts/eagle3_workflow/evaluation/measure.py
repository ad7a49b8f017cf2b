"""The measurement process, the stage's only ``-m`` entry: ``python -m eagle3_workflow.evaluation.measure
--spec spec.json --result result.json``, a runtime.worker (MeasurementSpec in, MeasurementResult out). It starts
each engine of the spec in turn (vllm.LLM, offline), warms it up, times the greedy passes and reads vLLM's
spec-decode counters before and after the first measured one; its output goes to the stage's log with a
``[eval-vllm]`` prefix. Only this module imports vLLM, inside the functions,
so the stage process never does.

Greedy decoding (temperature 0). The lossless pass asks for the top-5 raw logits of every generated token
(``logprobs_mode="raw_logits"`` among the engine's kwargs): the check compares tokens, and judges any divergence
by the logits of both runs. The timing passes ask for no logprobs, as a user serving the draft would not.

Processes that run at once (``evaluate.concurrent_processes``) share one lock file (``MeasurementSpec.lock_path``,
gate.Gate): each holds it shared while it imports vLLM, starts an engine, warms it up and runs a lossless pass, and
exclusive for a timing pass, so tokens/s are measured while no other process compiles, captures graphs or
generates. Without a lock path every Gate call is a no-op: the process runs as it did alone."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any

from eagle3_workflow.evaluation.gate import Gate
from eagle3_workflow.evaluation.protocol import (
    LOG_PREFIX,
    ConcurrencyTiming,
    MeasurementResult,
    MeasurementRun,
    MeasurementSpec,
    RunResult,
)
from eagle3_workflow.files.artefacts import write

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


def import_vllm() -> float:
    """Import vLLM (and the progress bar's tqdm); the seconds it took."""
    started = time.perf_counter()
    import vllm  # noqa: F401

    from eagle3_workflow.runtime.worker import engine_progress_bar  # noqa: F401

    return time.perf_counter() - started


PREPARED_IMPORT_S: list[float] = []  # set by prepare: vLLM was imported before the spec came


def prepare() -> None:
    """A process started before its spec (runtime.worker.start_worker, ``--await-spec``) imports vLLM while the stage
    still builds the spec, with the kernels its environment names: the stage set VLLM_BATCH_INVARIANT for the
    process it planned (launch.kernels_environment); `measure` refuses a spec that asks for the other kernels."""
    PREPARED_IMPORT_S.append(import_vllm())


def measure(spec: MeasurementSpec) -> MeasurementResult:
    """Start each engine in turn, warm it up, run its lossless and timing passes, read its counters."""
    gate = Gate(spec.lock_path, spec.log_prefix)
    gate.hold("import")
    if PREPARED_IMPORT_S:
        if (numerics() == "batch_invariant") != spec.batch_invariant:
            raise RuntimeError(
                f"this process imported vLLM with {numerics()} kernels before its spec came, and the spec asks for "
                f"batch_invariant={spec.batch_invariant}: the stage started it with the wrong environment (a bug)"
            )
        import_s = PREPARED_IMPORT_S[0]
    else:
        use_kernels(batch_invariant=spec.batch_invariant)
        import_s = import_vllm()
    import vllm  # imported above, with the kernels chosen: nothing to load here

    from eagle3_workflow.runtime.worker import engine_progress_bar

    progress_bar = engine_progress_bar()  # one marker per finished request: the parent's stall watch
    print(f"{spec.log_prefix}vllm {vllm.__version__} imported in {import_s:.1f} s ({numerics()} kernels)", flush=True)
    results = [measure_run(spec, run, progress_bar, gate) for run in spec.runs]
    return MeasurementResult(vllm_version=vllm.__version__, import_s=import_s, runs=results,
                             lock_wait_s=dict(gate.waited_s))  # fmt: skip


def use_kernels(*, batch_invariant: bool) -> None:
    """vLLM's batch-invariant kernels for this whole process, or its production ones (an inherited switch removed):
    set before vLLM is imported; the engine processes vLLM starts inherit it."""
    if batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    else:
        os.environ.pop("VLLM_BATCH_INVARIANT", None)


def numerics() -> str:
    """The kernels this process runs with (use_kernels, from the spec)."""
    return "batch_invariant" if os.environ.get("VLLM_BATCH_INVARIANT") == "1" else "production"


def measure_run(spec: MeasurementSpec, run: MeasurementRun, progress_bar: Any, gate: Gate | None = None) -> RunResult:
    """One engine: start it, warm it up (excluded), run its passes; shut it down even on failure. The result is
    written to run.result_path at once, so a cut later in this process loses nothing measured. With an active
    gate the timing passes wait for the lock alone and warm the engine up again once they hold it."""
    from vllm import SamplingParams

    from eagle3_workflow.runtime.worker import report_busy

    gate = gate or Gate(None)
    prefix = spec.log_prefix
    llm, engine_start_s = start_engine(spec, run, gate)
    prompts = [{"prompt_token_ids": ids} for ids in spec.prompts]
    indices = lossless_indices(run, len(prompts))
    lossless = LosslessPass(outputs=[], generate_s=0.0, before=[], after=[])
    parity = ParityPass(outputs=[], steps=[], proposals=None)
    timings: list[ConcurrencyTiming] = []
    try:
        warm_up = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
        report_busy()
        llm.generate(prompts[:1], warm_up, use_tqdm=progress_bar)
        stepped = parity_in_lossless(run, spec)
        if run.lossless_pass:
            gate.hold("lossless")
            lossless = lossless_pass(llm, [prompts[i] for i in indices], SamplingParams(**measured_sampling(spec)),
                                     progress_bar, alone=run.lossless_alone, stepped=stepped,
                                     prefix=prefix)  # fmt: skip
            parity = lossless.parity or parity
        if run.parity_prompts and run.speculative_config and (run.lossless_pass or not run.timing_pass) and not stepped:
            parity = parity_pass(llm, spec.prompts[: run.parity_prompts], spec)
        if run.timing_pass:
            timings = timing_passes(llm, spec, prompts, gate=gate, warm_up=warm_up, progress_bar=progress_bar)
    finally:
        _shutdown(llm)
        del llm
        _release_engine()
    result = run_result(run, lossless, engine_start_s=engine_start_s, timings=timings, prefix=prefix)
    result = result.model_copy(
        update={"parity_outputs": parity.outputs, "parity_steps": parity.steps, "parity_proposals": parity.proposals,
                "prompt_indices": indices if run.lossless_prompts is not None else None}
    )  # fmt: skip
    if run.result_path:
        write(run.result_path, result)
    return result


def start_engine(spec: MeasurementSpec, run: MeasurementRun, gate: Gate) -> tuple[Any, float]:
    """The run's engine (vllm.LLM: the spec's engine kwargs with the run's overrides and draft), started once the
    gate lets it, and its start time in seconds."""
    from vllm import LLM

    from eagle3_workflow.runtime.worker import report_idle
    from eagle3_workflow.serving.cpu_server import freeze_heap_for_cpu_engine

    kwargs = dict(spec.engine) | dict(run.engine_overrides)
    if run.speculative_config:
        kwargs["speculative_config"] = dict(run.speculative_config)
    report_idle()  # loading an engine (or waiting for the lock) is bounded by evaluate.timeout_s, not the stall watch
    gate.hold("engine_start")
    print(f"{spec.log_prefix}{run.label}: starting the engine ({kwargs})", flush=True)
    # vLLM's start-up collections skip what is alive now (the previous engine released); at TP > 1 on CPU its
    # EngineCore is forked from here
    freeze_heap_for_cpu_engine(kwargs["tensor_parallel_size"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    return llm, time.perf_counter() - t0


def timing_passes(
    llm: Any, spec: MeasurementSpec, prompts: list[dict[str, Any]], *, gate: Gate, warm_up: Any, progress_bar: Any
) -> list[ConcurrencyTiming]:
    """The timing passes at each of the spec's concurrencies; with an active gate once the lock is held alone, the
    engine warmed up again first."""
    from vllm import SamplingParams

    from eagle3_workflow.runtime.worker import report_busy, report_idle

    if gate.active:
        report_idle()  # waiting for the others' starts, lossless and timing passes is not a stall
        gate.hold("timing")
        report_busy()
        # warmed up again once alone: the first measured pass finds the engine as the others will
        llm.generate(prompts[:1], warm_up, use_tqdm=progress_bar)
    timed = prompts[: spec.timing_prompts or len(prompts)]
    sampling = SamplingParams(**(measured_sampling(spec) | {"logprobs": None}))
    return [timed_at_concurrency(llm, timed, sampling, concurrency=c, repeats=spec.timing_repeats,
                                 progress_bar=progress_bar, prefix=spec.log_prefix)
            for c in spec.timing_concurrency]  # fmt: skip


def parity_in_lossless(run: MeasurementRun, spec: MeasurementSpec) -> int:
    """How many of the lossless pass's first prompts give the parity pass's facts too (0: the parity pass runs
    apart). A speculative lossless pass that generates every prompt alone, in order, generates the parity pass's
    prompts (the first N) exactly as the parity pass would: the same engine, one request, greedy, the same stop
    token ids; so it steps those through the engine itself (step_request) and records each step's tokens and the
    draft's proposals, instead of generating them a second time (the SmolLM2 demo's parity pass: 18-19 s of 4
    prompts). Not with stop strings, which the parity pass leaves out: a step cut by one would not be the
    engine's step."""
    if not (run.parity_prompts and run.speculative_config and run.lossless_pass and run.lossless_alone):
        return 0
    if spec.stop or run.lossless_prompts is not None:
        return 0
    return min(run.parity_prompts, len(spec.prompts))


def lossless_indices(run: MeasurementRun, num_prompts: int) -> list[int]:
    """The prompts the run's lossless pass generates: its lossless_prompts that exist (the stage plans the untrained
    draft's first N before it knows how many prompts there are), or every prompt."""
    if run.lossless_prompts is None:
        return list(range(num_prompts))
    return [i for i in run.lossless_prompts if 0 <= i < num_prompts]


def _release_engine() -> None:
    """Give the engine's memory and distributed state back before the next engine of this process starts, as
    vLLM's own tests do between engines (its cleanup also unfreezes the objects vLLM froze out of gc at start)."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        gc.collect()
        return
    cleanup_dist_env_and_memory()


def parity_pass(llm: Any, prompts: list[list[int]], spec: MeasurementSpec) -> ParityPass:
    """The draft parity pass: each prompt alone, greedily, through vLLM's engine one step at a time with DELTA
    outputs, so each step's new tokens are that step's accepted draft tokens + the bonus token (the prefill's
    step: its first token). With the engine in this process and no async scheduling, the draft's proposals after
    each step are read from the scheduler's request (what the next step verifies). Stop token ids only (no stop
    strings: the steps are what is compared)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, stop_token_ids=list(spec.stop_token_ids) or None,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    engine = llm.llm_engine
    scheduler = in_process_scheduler(llm)
    result = ParityPass(outputs=[], steps=[], proposals=[] if scheduler is not None else None)
    started = time.perf_counter()
    for index, ids in enumerate(prompts):
        _, tokens, counts, proposed = step_request(engine, scheduler, f"parity-{index}", {"prompt_token_ids": ids},
                                                   params)  # fmt: skip
        result.outputs.append(tokens)
        result.steps.append(counts)
        if result.proposals is not None:
            result.proposals.append(proposed)
    print(f"{spec.log_prefix}  parity pass: {len(prompts)} prompt(s), {sum(map(len, result.steps))} engine steps, "
          f"{sum(map(len, result.outputs))} tokens in {time.perf_counter() - started:.2f} s, proposals "
          f"{'read' if scheduler is not None else 'not visible'}", flush=True)  # fmt: skip
    return result


def step_request(
    engine: Any, scheduler: Any, request_id: str, prompt: dict[str, Any], params: Any
) -> tuple[Any, list[int], list[int], list[list[int]]]:
    """One request alone through the engine, one step at a time: its final RequestOutput, its tokens, how many
    each step emitted (accepted + 1; the prefill's step: its first token) and, with a `scheduler`, the draft's
    proposals after each step. DELTA outputs carry each step's new tokens, CUMULATIVE ones (what LLM.generate
    asks for) all of them so far."""
    from vllm.sampling_params import RequestOutputKind

    delta = params.output_kind == RequestOutputKind.DELTA
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    counts: list[int] = []
    proposed: list[list[int]] = []
    final = None
    while engine.has_unfinished_requests():
        for request in engine.step():
            ids = list(request.outputs[0].token_ids) if request.outputs else []
            new = ids if delta else ids[len(tokens) :]
            if new:
                tokens += new
                counts.append(len(new))
                if scheduler is not None:
                    waiting = list(scheduler.requests.values())
                    proposed.append([int(t) for t in waiting[0].spec_token_ids] if len(waiting) == 1 else [])
            if request.finished:
                final = request
    return final, tokens, counts, proposed


def in_process_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process engine without async scheduling (its requests hold the draft's proposals
    between steps), else None."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None or getattr(core, "async_scheduling", False):
        return None
    return getattr(core, "scheduler", None)


@dataclasses.dataclass
class ParityPass:
    outputs: list[list[int]]
    steps: list[list[int]]
    proposals: list[list[list[int]]] | None  # per prompt, per step: the proposals made after it (None: not visible)


@dataclasses.dataclass
class LosslessPass:
    outputs: list[Any]
    generate_s: float
    before: list[dict[str, Any]]
    after: list[dict[str, Any]]
    parity: ParityPass | None = None  # the first prompts' steps, when the pass stepped them (parity_in_lossless)


def lossless_pass(
    llm: Any,
    prompts: list[dict[str, Any]],
    sampling: Any,
    progress_bar: Any,
    *,
    alone: bool = False,
    stepped: int = 0,
    prefix: str = LOG_PREFIX,
) -> LosslessPass:
    """Every prompt at once (or, `alone`, each prompt by itself, in order), greedily, with the top-k raw logits of
    each step; the counters around it. `stepped` (alone only): the first prompts go through the engine one step at
    a time (step_request), their steps recorded as the parity pass's."""
    from eagle3_workflow.runtime.worker import report_progress

    before = _spec_metrics(llm)
    t0 = time.perf_counter()
    parity = None
    if alone:
        outputs = []
        scheduler = in_process_scheduler(llm) if stepped else None
        parity = ParityPass(outputs=[], steps=[], proposals=[] if scheduler is not None else None) if stepped else None
        for index, prompt in enumerate(prompts):
            if parity is None or index >= stepped:
                outputs += llm.generate([prompt], sampling, use_tqdm=progress_bar)
                continue
            output, tokens, counts, proposed = step_request(llm.llm_engine, scheduler, f"lossless-{index}", prompt,
                                                            sampling)  # fmt: skip
            report_progress()  # a finished request, as the progress bar of LLM.generate reports it
            outputs.append(output)
            parity.outputs.append(tokens)
            parity.steps.append(counts)
            if parity.proposals is not None:
                parity.proposals.append(proposed)
        if parity is not None:
            print(f"{prefix}  parity pass within the lossless pass: its first {len(parity.steps)} prompt(s), "
                  f"{sum(map(len, parity.steps))} engine steps, proposals "
                  f"{'read' if parity.proposals is not None else 'not visible'}", flush=True)  # fmt: skip
    else:
        outputs = llm.generate(prompts, sampling, use_tqdm=progress_bar)
    generate_s = time.perf_counter() - t0
    return LosslessPass(outputs=outputs, generate_s=generate_s, before=before, after=_spec_metrics(llm), parity=parity)


def timed_at_concurrency(
    llm: Any,
    prompts: list[dict[str, Any]],
    sampling: Any,
    *,
    concurrency: int,
    repeats: int,
    progress_bar: Any,
    prefix: str = LOG_PREFIX,
) -> ConcurrencyTiming:
    """`repeats` passes over `prompts`, `concurrency` requests at a time; the drafts proposed in the first."""
    from eagle3_workflow.evaluation.metrics import counters_from_metrics

    passes, generated, verify_steps = [], 0, None
    for repeat in range(repeats):
        before = counters_from_metrics(_spec_metrics(llm))
        t0 = time.perf_counter()
        tokens = 0
        for start in range(0, len(prompts), concurrency):
            batch = llm.generate(prompts[start : start + concurrency], sampling, use_tqdm=progress_bar)
            tokens += sum(len(request.outputs[0].token_ids) for request in batch)
        passes.append(time.perf_counter() - t0)
        if repeat == 0:
            generated = tokens
            after = counters_from_metrics(_spec_metrics(llm))
            if after is not None:
                verify_steps = after.num_drafts - (before.num_drafts if before else 0)
    timing = ConcurrencyTiming(concurrency=concurrency, prompts=len(prompts), generated_tokens=generated,
                               seconds=min(passes), seconds_passes=passes, verify_steps=verify_steps)  # fmt: skip
    print(f"{prefix}  concurrency {concurrency}: {generated} tokens in {timing.seconds:.2f} s "
          f"({timing.tokens_per_s:.1f} tokens/s)", flush=True)  # fmt: skip
    return timing


def run_result(
    run: MeasurementRun,
    lossless: LosslessPass,
    *,
    engine_start_s: float,
    timings: list[ConcurrencyTiming],
    prefix: str = LOG_PREFIX,
) -> RunResult:
    """The RunResult of one engine from vLLM's RequestOutputs; its summary line goes to the log."""
    completions = [request.outputs[0] for request in lossless.outputs]
    token_ids = [list(c.token_ids) for c in completions]
    generated_tokens = sum(len(ids) for ids in token_ids)
    passes = (f"lossless pass {generated_tokens} tokens in {lossless.generate_s:.2f} s" if run.lossless_pass
              else f"timing passes at concurrency {', '.join(str(t.concurrency) for t in timings)}")  # fmt: skip
    print(f"{prefix}{run.label}: engine start {engine_start_s:.1f} s, {passes} ({numerics()} kernels)", flush=True)
    return RunResult(
        label=run.label,
        key=run.key,
        numerics=numerics(),
        engine_start_s=engine_start_s,
        generate_s=lossless.generate_s,
        generated_tokens=generated_tokens,
        outputs=token_ids,
        finish_reasons=[str(c.finish_reason) for c in completions],
        top_logits=[
            [{int(tok): float(lp.logprob) for tok, lp in step.items()} for step in (c.logprobs or [])]
            for c in completions
        ],
        metrics_before=lossless.before,
        metrics_after=lossless.after,
        load_1m=os.getloadavg()[0],
        timings=timings,
    )


if __name__ == "__main__":  # vLLM's spawned processes re-import __main__: the guard keeps them from re-running it
    from eagle3_workflow.runtime.worker import serve

    serve(MeasurementSpec, measure, name="evaluate_draft (measurement process)", prepare=prepare)
