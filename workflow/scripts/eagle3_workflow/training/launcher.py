"""One launch of the trainer through runtime.ChildProcess (the trainer entry, or torchrun on several GPUs): its
environment, its output log, and what a failure or a stop signal means for the rerun."""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_workflow.files.disk import space_of
from eagle3_workflow.files.draft_artefacts import CheckpointInfo
from eagle3_workflow.runtime.child import ChildProcess, first_traceback, traceback_span
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.command import TrainDevice
from eagle3_workflow.trainer.entry import DEVICE_ENV, METRICS_ENV
from eagle3_workflow.training.checkpoint_space import checkpoint_write_failure, write_failure_sentence
from eagle3_workflow.training.checkpoints import latest_checkpoint, outlook_on_disk
from eagle3_workflow.training.workdir import attempt_files

log = logging.getLogger("eagle3.training")

TAIL_LINES = 40
# how long a stopped trainer may take to save checkpoints/interrupted before its tree is killed: speculators' own
# limit for that save (graceful_shutdown.DEFAULT_SHUTDOWN_TIMEOUT, after which it exits by itself), plus a margin.
# Under SLURM the job's KillWait (30 s by default) ends it sooner; a save cut short is ignored by the rerun.
INTERRUPT_SAVE_GRACE_S = 125.0

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_WORKER_SIGNAL = re.compile(r"DataLoader worker \(pid[^)]*\) is killed by signal: ([\w .]+)")
_SIGNAL_NUMBERS = {s.value for s in signal.Signals}
_PROGRESS_RUN = re.compile(r"([\u2500-\u259f])\1{39,}")


def clean_trainer_line(line: str) -> str:
    """A trainer output line as worth reading: no colour codes, progress bars shortened."""
    return _PROGRESS_RUN.sub(lambda m: m.group(1) * 40, _ANSI.sub("", line).rstrip())


def run_trainer(
    command: list[str],
    *,
    env: dict[str, str],
    attempt_log: Path,
    on_line: Callable[[str], None],
    watch: Callable[[], None] | None = None,
) -> tuple[int, list[str]]:
    """Run the trainer, streaming each output line to ``on_line`` and ``attempt_log``; returns (rc, kept lines).

    A stop signal to the stage stops the trainer's whole tree (runtime.stage's policy); the trainer's tree
    (torchrun ranks, DataLoader workers) dies with the stage even when the stage is SIGKILLed. ``watch`` is called
    twice a second while it runs (online training: the server's health); what it raises stops the trainer (it
    saves checkpoints/interrupted) and ends the attempt.
    """
    attempt_log.parent.mkdir(parents=True, exist_ok=True)
    attempt_log.write_text(f"# {' '.join(command)}\n", encoding="utf-8")
    child = ChildProcess(
        command,
        name="speculators train",
        env=env,
        log_path=attempt_log,
        on_line=on_line,
        clean=clean_trainer_line,
        head_lines=2000,  # a traceback is usually here (start-up) ...
        tail_lines=400,  # ... or here (a failure after hours)
        stop_grace_s=INTERRUPT_SAVE_GRACE_S,
        watch=watch,
    )
    with child:
        rc = child.wait()
    return rc, child.output()


def stop_signal(rc: int, lines: Sequence[str]) -> str | None:
    """The signal that stopped the trainer, if one did: the trainer's own, or one its DataLoader workers got
    (the trainer then exits 1 with the worker's traceback, which hides what happened)."""
    if rc < 0:
        return signal.Signals(-rc).name
    if rc - 128 in _SIGNAL_NUMBERS:  # a shell or launcher reporting "killed by signal N" as 128 + N
        return signal.Signals(rc - 128).name
    descriptions = {signal.strsignal(s): s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for line in lines:
        found = _WORKER_SIGNAL.search(line)
        description = found.group(1).strip().rstrip(".") if found else ""
        if description in descriptions:
            return descriptions[description]
    return None


def _shorten(line: str, limit: int = 400) -> str:
    return line if len(line) <= limit else f"{line[:limit]}... ({len(line) - limit} more characters)"


def trainer_failure(
    rc: int, command: list[str], lines: list[str], attempt_log: Path, *, checkpoint_bytes: int | None = None
) -> StageError:
    """The failure as a person reads it: a failed checkpoint write's cause and fix first (a full disk shows in
    torch.save only as a stream error), then how it ended, the first traceback, and the lines around it."""
    if rc < 0:
        how = f"was killed by signal {signal.Signals(-rc).name}" + (" (out of memory?)" if rc == -9 else "")
    else:
        how = f"exited with code {rc}"
    span = traceback_span(lines)
    if span is None:
        context = f"(no Python traceback in its output)\nLast {TAIL_LINES} lines:\n" + "\n".join(
            _shorten(line) for line in lines[-TAIL_LINES:]
        )
    else:
        quoted = f"First traceback:\n{first_traceback(lines)}"
        after = [line for line in lines[span[1] :] if line.strip()]
        if len(after) <= 5:  # the traceback ended the run: what led to it is more useful than a repeat of it
            before = "\n".join(_shorten(line) for line in lines[max(0, span[0] - 15) : span[0]])
            context = f"Before it:\n{before}\n{quoted}" + ("\nAfter it:\n" + "\n".join(after) if after else "")
        else:
            context = f"{quoted}\nLast {TAIL_LINES} lines:\n" + "\n".join(
                _shorten(line) for line in lines[-TAIL_LINES:]
            )
    save_dir = attempt_log.parent.parent / "checkpoints"
    write_failed = checkpoint_write_failure(lines)
    cause = ""
    if write_failed is not None:
        space = space_of(save_dir)
        cause = write_failure_sentence(write_failed, space, save_dir=save_dir, per_checkpoint=checkpoint_bytes) + "\n"
    return StageError(
        f"{cause}speculators train {how}.\ncommand: {' '.join(command)}\n{context}\n"
        f"Full output: {attempt_log}. Checkpoints written so far stay in {save_dir} "
        "and the rerun resumes from the newest complete one."
    )


def trainer_env(device: TrainDevice, cpu_threads: int | None) -> dict[str, str]:
    from eagle3_workflow.runtime import child_environment

    env = child_environment()
    env.pop("FORCE_COLOR", None)
    env.pop(DEVICE_ENV, None)
    if device.kind == "cpu":
        env[DEVICE_ENV] = "cpu"  # the trainer entry applies the CPU shim
        if cpu_threads and "OMP_NUM_THREADS" not in env:
            # the job's threads shared among its ranks (torchrun would set 1 a rank): ranks x threads = the job's
            env["OMP_NUM_THREADS"] = str(max(1, cpu_threads // device.processes))
        # OpenMP threads that spin at every barrier take the cores from whatever else runs there: the tiny run's
        # training took 116.6 s with GNU OpenMP's default waiting against 31.2 s passive beside two busy processes on
        # 2 cores, 23.2 s against 27.3 s alone (bench/suite/bench_omp_wait.py, 2026-12-04). vLLM's CPU engines wait
        # passively too (runtime.child_environment). A value in the environment wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_attempt(
    command: list[str],
    *,
    env: dict[str, str],
    logs_dir: Path,
    save_dir: Path,
    epochs: int,
    on_line: Callable[[str], None],
    watch: Callable[[], None] | None = None,
    checkpoint_bytes: int | None = None,
) -> CheckpointInfo:
    """One launch of the trainer, logged to its own file; the final checkpoint, or StageError saying why not."""
    attempt = len(list(logs_dir.glob("trainer-attempt-*.log"))) + 1
    attempt_log, metrics_jsonl = attempt_files(logs_dir, attempt)
    metrics_jsonl.unlink(missing_ok=True)  # left by a launch whose log was deleted: not this attempt's steps
    log.info("attempt %d (output also in %s): %s", attempt, attempt_log, " ".join(command))
    env = {**env, METRICS_ENV: str(metrics_jsonl)}
    rc, lines = run_trainer(command, env=env, attempt_log=attempt_log, on_line=on_line, watch=watch)
    stopped_by = stop_signal(rc, lines) if rc != 0 else None
    if stopped_by not in (None, "SIGKILL"):  # SIGKILL: more likely the OOM killer than a stop request
        raise StageError(
            f"speculators train was stopped by a signal ({stopped_by}); {outlook_on_disk(save_dir, logs_dir, epochs)}. "
            f"Output: {attempt_log}"
        )
    if rc != 0:
        raise trainer_failure(rc, command, lines, attempt_log, checkpoint_bytes=checkpoint_bytes)
    final = latest_checkpoint(save_dir)
    if final is not None and final.ends_training(epochs):
        return final
    if any("Training interrupted" in line for line in lines):
        # speculators catches the signal, saves interrupted/ and exits 0
        raise StageError(
            "speculators train was stopped by a signal (SIGTERM/SIGINT: a job time limit, scancel or Ctrl-C); "
            f"{outlook_on_disk(save_dir, logs_dir, epochs)}. Output: {attempt_log}"
        )
    raise StageError(
        f"speculators train exited 0 but the last complete checkpoint in {save_dir} is "
        f"{final.path if final else None}, not the end of epoch {epochs - 1}; see {attempt_log}"
    )
