"""Running evaluate_draft's planned measurements (plan): the measurement processes one after another or all at once,
each engine's result reused where an earlier attempt left it with the same key (resume), and what they returned
gathered in Measured. The processes themselves are launch's (the stage's side) and measure's (the process).

Processes that run one after another: the first is started before the stage loads the tokenizer and prompts and
builds the untrained draft (start_first_process, runtime.worker.start_worker), so its vLLM import runs beside that
work; it gets its spec once the prompts are known, or is stopped when an earlier attempt's results leave it nothing
to do.

With the untrained draft as the lossless reference (CPU, plan.lossless_reference) the untrained draft generates
only its first ``evaluate.untrained_prompts`` prompts in the planned processes (its acceptance) and, in one more
process afterwards, each other prompt where the trained draft's greedy output differs from the run without
speculation (measure_untrained_reference): where the two are equal token for token the trained draft is lossless
by definition and nothing needs the reference. Accepting nothing, the untrained draft costs k draft forwards and a
1 + k-row verification per token: on the SmolLM2 demo its pass of all 32 prompts was 177 s of the stage's 461 s
(2026-12-06).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_workflow.evaluation.launch import Launch, run_measurement_process, run_measurement_processes
from eagle3_workflow.evaluation.plan import PlannedProcess, plan_environment
from eagle3_workflow.evaluation.prompts import PromptSet
from eagle3_workflow.evaluation.protocol import (
    LOG_PREFIX,
    NO_SPECULATION,
    MeasurementResult,
    MeasurementRun,
    MeasurementSpec,
    RunResult,
    log_prefix,
)
from eagle3_workflow.evaluation.resume import keyed_run, reusable_result, run_role
from eagle3_workflow.files.chat import StopSet
from eagle3_workflow.files.draft_artefacts import MeasurementProcess
from eagle3_workflow.settings.sections import EvaluationSettings, VllmSettings

if TYPE_CHECKING:
    from eagle3_workflow.runtime.worker import StartedWorker

log = logging.getLogger("eagle3.evaluation")

# the untrained draft's lossless pass on the prompts where the trained draft's output differs from the run without
# speculation, beyond the first evaluate.untrained_prompts (measure_untrained_reference)
UNTRAINED_DIVERGENT = "untrained_divergent"


@dataclasses.dataclass
class Measured:
    """What the measurement processes returned: each label's lossless pass and timing passes (the same engine
    with production numerics), each process's timings, vLLM's version."""

    lossless: dict[str, RunResult]
    timing: dict[str, RunResult]
    processes: list[MeasurementProcess]
    vllm_version: str = ""
    concurrent: bool = False  # the processes ran at once, each timing pass under the exclusive lock
    # engines an earlier attempt of the stage measured with the same key (<label>.<role>), not run again: their
    # processes are not in `processes`
    reused: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What every step of one evaluation shares: its settings, the device, the prompts and stop set, its work folder."""

    settings: EvaluationSettings
    vllm_settings: VllmSettings
    device: str
    prompt_set: PromptSet
    stop: StopSet
    work_dir: Path
    concurrent: bool = False  # the measurement processes start at once (concurrent_processes)


def measure_evaluation(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str],
    first: FirstProcess | None,
    reference: str,
) -> Measured:
    """The planned processes (measure_runs) and, with the untrained draft as the lossless reference, its run of
    each prompt where the trained draft changed the output (measure_untrained_reference)."""
    measured = measure_runs(plan, engine, evaluation, log_path=log_path, env=env, first=first, reference=reference)
    if reference == "untrained":
        measure_untrained_reference(measured, plan, engine, evaluation, log_path=log_path, env=env)
    return measured


def measure_runs(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str] | None = None,
    first: FirstProcess | None = None,
    reference: str = NO_SPECULATION,
    first_index: int = 0,
) -> Measured:
    """Run the planned processes: one after another, or all at once (evaluation.concurrent) with a lock file that
    keeps each timing pass alone. An engine whose result a cut run left in work_dir/runs with the same key
    (everything that decides its result) is reused, not measured again. `env`: the processes' environment
    (plan_environment, taken when the stage started; None: taken now). `first`: the first planned process, started
    early (start_first_process); it gets its spec if it is still the first to run, and is stopped otherwise.
    `first_index`: the number of the plan's first process (measure_<i>), for a plan that follows another."""
    settings, vllm_settings, work_dir = evaluation.settings, evaluation.vllm_settings, evaluation.work_dir
    measured = Measured(lossless={}, timing={}, processes=[])
    spec_fields = measurement_spec_fields(evaluation)
    pending = runs_to_measure(plan, engine, spec_fields, measured, work_dir=work_dir, first_index=first_index)
    if not pending:
        return measured
    env = env if env is not None else plan_environment(plan, engine, settings, vllm_settings, evaluation.device,
                                                       reference=reference)  # fmt: skip
    together = evaluation.concurrent and len(pending) > 1
    measured.concurrent = together
    launches = []
    for i, process, todo in pending:
        spec = MeasurementSpec(engine=engine, runs=todo, batch_invariant=process.batch_invariant,
                               lock_path=str(work_dir / "measure.lock") if together else None,
                               log_prefix=process_log_prefix(todo, i) if together else LOG_PREFIX,
                               **spec_fields)  # fmt: skip
        launches.append(Launch(spec=spec, name=f"measure_{i}", env=env))
    finished = run_launches(launches, evaluation, log_path=log_path, first=first, together=together)
    for launch, (result, wall_s) in zip(launches, finished, strict=True):
        record_process(measured, launch, result, wall_s)
    return measured


def measurement_spec_fields(evaluation: Evaluation) -> dict[str, Any]:
    """What every measurement spec of the evaluation holds besides its engines: the prompts, the generation's
    length and stop set, the timing passes."""
    settings, stop = evaluation.settings, evaluation.stop
    return dict(prompts=[p.token_ids for p in evaluation.prompt_set.prompts], max_tokens=settings.max_tokens,
                timing_repeats=settings.timing_repeats, stop_token_ids=stop.token_ids, stop=stop.strings,
                timing_concurrency=list(settings.timing_concurrency), timing_prompts=settings.timing_prompts)  # fmt: skip


def runs_to_measure(
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    spec_fields: dict[str, Any],
    measured: Measured,
    *,
    work_dir: Path,
    first_index: int,
) -> list[tuple[int, PlannedProcess, list[MeasurementRun]]]:
    """Each planned process's runs with their keys (resume.keyed_run): a result an earlier attempt left with the
    same key goes into `measured` now; the runs still to measure are returned with their process and its number."""
    fingerprints: dict[Path, dict[str, str]] = {}  # each model folder hashed once (a 135M target: ~0.5 s a time)
    pending: list[tuple[int, PlannedProcess, list[MeasurementRun]]] = []
    for i, process in enumerate(plan, start=first_index):
        keyed = [keyed_run(run, engine, spec_fields, batch_invariant=process.batch_invariant, work_dir=work_dir,
                           fingerprints=fingerprints) for run in process.runs]  # fmt: skip
        todo = []
        for run in keyed:
            earlier = reusable_result(run)
            if earlier is None:
                todo.append(run)
            else:
                log.info("reusing %s (measured by an earlier attempt, same key %s)", run.result_path, run.key[:12])
                record(measured, run, earlier)
                measured.reused.append(f"{run.label}.{run_role(run)}")
        if todo:
            pending.append((i, process, todo))
    return pending


def run_launches(
    launches: list[Launch],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    first: FirstProcess | None,
    together: bool,
) -> list[tuple[MeasurementResult, float]]:
    """Each launch's result and wall time: all at once (`together`), or one after another, the first on the
    process started early if it is the one to run (FirstProcess.take)."""
    settings, vllm_settings, work_dir = evaluation.settings, evaluation.vllm_settings, evaluation.work_dir
    watch = dict(log_path=log_path, timeout_s=settings.timeout_s, stall_timeout_s=vllm_settings.stall_timeout_s)
    started = first.take(launches[0]) if first is not None and not together else None
    if together:
        return run_measurement_processes(launches, work_dir, **watch)
    return [run_measurement_process(launch.spec, work_dir, launch.name, env=launch.env, **watch,
                                    started=started if i == 0 else None)
            for i, launch in enumerate(launches)]  # fmt: skip


def record_process(measured: Measured, launch: Launch, result: MeasurementResult, wall_s: float) -> None:
    """A finished process's runs and its timings into `measured`."""
    measured.vllm_version = result.vllm_version
    for run, run_result in zip(launch.spec.runs, result.runs, strict=True):
        record(measured, run, run_result)
    measured.processes.append(
        MeasurementProcess(
            runs=[f"{r.label} ({r.numerics})" for r in result.runs],
            wall_s=round(wall_s, 2),
            vllm_import_s=round(result.import_s, 2),
            engine_start_s={r.label: round(r.engine_start_s, 2) for r in result.runs},
            load_1m=round(os.getloadavg()[0], 2),
            lock_wait_s={mode: round(s, 2) for mode, s in result.lock_wait_s.items()},
        )
    )


def record(measured: Measured, run: MeasurementRun, result: RunResult) -> None:
    if run.lossless_pass:
        measured.lossless[run.label] = result
    if run.timing_pass:
        measured.timing[run.label] = result


def process_log_prefix(runs: list[MeasurementRun], index: int) -> str:
    """The log prefix of a process that runs beside others: its engine (trained.timing), or its number."""
    return log_prefix(f"{runs[0].label}.{run_role(runs[0])}" if len(runs) == 1 else f"measure_{index}")


@dataclasses.dataclass
class FirstProcess:
    """The first planned measurement process, started before its spec (start_first_process): its name, the kernels
    it imported vLLM with and its environment without them, and the started worker (a context manager)."""

    name: str
    batch_invariant: bool
    env: dict[str, str]
    worker: StartedWorker

    def take(self, launch: Launch) -> StartedWorker | None:
        """The started worker, to run `launch` with, if `launch` is the process it was started as: same name (the
        first in the plan, not reused away by an earlier attempt's results), same kernels, same environment. Else
        None, and the worker is stopped now: the processes that run instead must not share the machine with it."""
        if (launch.name, launch.spec.batch_invariant, launch.env) == (self.name, self.batch_invariant, self.env):
            return self.worker
        changed = sorted(k for k in self.env.keys() | launch.env.keys() if self.env.get(k) != launch.env.get(k))
        log.info("%s, started early, is not the process to run first (%s; batch_invariant %s, environment "
                 "variables changed: %s): stopped", self.name, launch.name, launch.spec.batch_invariant,
                 changed or "none")  # fmt: skip
        self.worker.stop()
        return None

    def __enter__(self) -> FirstProcess:
        self.worker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.worker.finished:
            log.info("%s, started early, got no spec (every run's result reused, or the stage failed first): stopped",
                     self.name)  # fmt: skip
        self.worker.__exit__(*exc)


def start_first_process(
    plan: list[PlannedProcess],
    env: dict[str, str],
    *,
    settings: EvaluationSettings,
    vllm_settings: VllmSettings,
    work_dir: Path,
    log_path: str | Path | None,
) -> FirstProcess:
    """The first process of a one-after-another plan, to start before the stage loads the tokenizer and prompts and
    builds the untrained draft: it imports vLLM meanwhile (~3 s of a CPU run's measurement process, on the core the
    stage leaves idle), then waits for its spec (measure_runs gives it). Its environment is `env`, the one every
    process of the plan gets (plan_environment), with the kernels of the plan's first process."""
    from eagle3_workflow.evaluation.launch import kernels_environment, start_measurement_process

    process = plan[0]
    worker = start_measurement_process([run.label for run in process.runs], work_dir, "measure_0",
                                       env=kernels_environment(env, batch_invariant=process.batch_invariant),
                                       log_path=log_path, timeout_s=settings.timeout_s,
                                       stall_timeout_s=vllm_settings.stall_timeout_s)  # fmt: skip
    return FirstProcess(name="measure_0", batch_invariant=process.batch_invariant, env=env, worker=worker)


def prompt_outputs(run: RunResult) -> dict[int, tuple[list[int], list[dict[int, float]]]]:
    """A lossless pass's output and top-k logits by prompt index (RunResult.prompt_indices; None: every prompt)."""
    indices = run.prompt_indices if run.prompt_indices is not None else range(len(run.outputs))
    return {i: (ids, logits) for i, ids, logits in zip(indices, run.outputs, run.top_logits, strict=True)}


def differing_prompts(lossless: dict[str, RunResult]) -> list[int]:
    """The prompts whose greedy output with the trained draft is not token for token the one without speculation."""
    plain, trained = prompt_outputs(lossless[NO_SPECULATION]), prompt_outputs(lossless["trained"])
    return [i for i in sorted(trained) if trained[i][0] != plain[i][0]]


def measure_untrained_reference(
    measured: Measured,
    plan: list[PlannedProcess],
    engine: dict[str, Any],
    evaluation: Evaluation,
    *,
    log_path: str | Path | None,
    env: dict[str, str] | None,
) -> None:
    """With the untrained draft as the lossless reference: generate it, one prompt at a time as the trained draft
    was, on every prompt where the trained draft's greedy output differs from the run without speculation and that
    its first pass (the first evaluate.untrained_prompts) did not cover, in one more measurement process; its result
    goes to measured.lossless[UNTRAINED_DIVERGENT]. Where the trained draft's output equals the one without
    speculation token for token, it is lossless there by definition and no reference is needed: on the README's
    SmolLM2 demo that was every prompt (2026-12-06), and this process does not start."""
    differing = differing_prompts(measured.lossless)
    covered = set(prompt_outputs(measured.lossless["untrained"]))
    missing = [i for i in differing if i not in covered]
    log.info("the trained draft's greedy output differs from the run without speculation on %d of %d prompt(s)%s",
             len(differing), len(evaluation.prompt_set.prompts),
             f" {differing}: the untrained draft generates {missing or 'none'} as their reference (it covered "
             f"{sorted(covered)} already)" if differing else ": no reference needed")  # fmt: skip
    if not missing:
        return
    index, untrained = next((i, run) for i, process in enumerate(plan) for run in process.runs
                            if run.label == "untrained" and run.lossless_pass)  # fmt: skip
    run = untrained.model_copy(update={"label": UNTRAINED_DIVERGENT, "lossless_prompts": missing,
                                       "timing_pass": False, "lossless_pass": True})  # fmt: skip
    process = PlannedProcess(runs=[run], batch_invariant=plan[index].batch_invariant)
    extra = measure_runs([process], engine, evaluation, log_path=log_path, env=env, reference="untrained",
                         first_index=len(plan))  # fmt: skip
    measured.lossless |= extra.lossless
    measured.processes += extra.processes
    measured.vllm_version = measured.vllm_version or extra.vllm_version
