"""In the trainer process: make speculators' interrupt save (``checkpoints/interrupted``) resumable (speculators 0.9.0).

On SIGTERM/SIGINT speculators' trainer (``graceful_shutdown.with_graceful_shutdown`` around ``Trainer.run_training``)
saves the model, optimizer and scheduler to ``checkpoints/interrupted``, but records no epoch or step there (its
``training_state.json`` is written for numbered checkpoints only), and on start it ignores that folder. Its signal
handler also raises wherever the main thread is: between the optimizer step and ``global_step += 1`` the weights
are one step ahead of the step count the trainer holds. The trainer entry applies ``apply_interrupt_patches``:

- a stop signal that arrives between the optimizer step and the end of that step (the ``step_callback`` speculators
  calls right after ``global_step += 1``) is acted on at the end of the step, so weights, optimizer, scheduler and
  step count agree in what is saved. Everywhere else speculators' handler raises at once, as before. Signals
  after the first are ignored before speculators' handler takes its lock (it ignores them inside it, where a
  re-send that interrupts the first signal's handler waits forever);
- with several ranks (torchrun: GPUs, or CPU ranks through gloo), a stop signal inside ``train_epoch`` waits for the
  end of the step on every rank, where the ranks agree (one all-reduce of a flag, MAX, at each step's end): if any
  rank holds a signal, every rank stops there, a rank that got none as if it had. A rank that raised at once
  (in its forward, say) while another waited inside that step's gradient all-reduce left the two waiting for each
  other in mismatched collectives until torchrun killed them 30 s later, with nothing saved (measured: the stage
  stopped after 32 s, "the rerun starts training from scratch"). One process is unchanged: no agreement;
- before the interrupt save, a stale ``interrupted/`` from an earlier launch is removed (a save cut short must not
  leave old and new files side by side); after it, ``interrupted/training_state.json`` is written, last and
  atomically, in speculators' own format (``epoch``, ``local_step``, ``global_step``; ``local_step`` 0 = that epoch
  finished), so a save cut short (SIGKILL after SLURM's KillWait) has none and the rerun ignores it;
- once interrupted, the trainer ignores further SIGTERMs. speculators restores the default handlers before its
  save ("send again to force exit"), but a SIGTERM seldom comes alone: SLURM signals every process of the job, and
  the stage, signalled too, passes one on to the trainer (torchrun to its ranks), so the second one would kill the
  save the first one asked for. SIGINT (a person's second Ctrl-C) still forces the exit; speculators' own limit on
  the save (120 s) and the stage's (``training.launcher.INTERRUPT_SAVE_GRACE_S``) stay.

The rerun (``training/checkpoints.py``) compares it with the numbered checkpoints by their recorded global step and
moves the newest into the place speculators resumes from.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

INTERRUPTED = "interrupted"
STATE_FILE = "training_state.json"

# (module, attribute path inside it) of every speculators object this module wraps
INTERRUPT_PATCH_POINTS: list[tuple[str, str]] = [
    ("speculators.train.trainer", "Trainer.train_epoch"),
    ("speculators.train.trainer", "Trainer._optimizers_step"),
    ("speculators.train.trainer", "Trainer.maybe_save_checkpoint"),
    ("speculators.train.graceful_shutdown", "GracefulShutdownHandler._handler"),
    ("speculators.train.graceful_shutdown", "GracefulShutdownHandler.restore"),
    ("speculators.train.graceful_shutdown", "GracefulShutdownHandler.install"),
]
# attributes of speculators' shutdown handler the wrappers read
HANDLER_ATTRIBUTES = ("_interrupted", "_owner_pid")
_PATCHED_MARKER = "_eagle3_interrupt_patches"
_STOPPING = "_eagle3_stopping"  # set on speculators' shutdown handler by the first stop signal it gets

log = logging.getLogger("speculators")  # the trainer's own logger: its lines land in the attempt's log


def interrupt_record(epoch: int, steps_in_epoch: int, global_step: int, *, epoch_done: bool) -> dict[str, int]:
    """speculators' training_state for the trainer's state now (``local_step`` 0 means "that epoch finished")."""
    if epoch_done:
        return {"epoch": epoch, "local_step": 0, "global_step": global_step}
    if steps_in_epoch <= 0:  # nothing trained in this epoch yet: the state is the end of the previous one
        return {"epoch": epoch - 1, "local_step": 0, "global_step": global_step}
    return {"epoch": epoch, "local_step": steps_in_epoch, "global_step": global_step}


def interrupt_patch_points_present() -> list[tuple[str, bool, str]]:
    """For each patch point: (``module:attribute``, present, what was found), plus ``step_callback`` in
    ``Trainer.train_epoch``'s signature (the end of a step, where a deferred signal is acted on)."""
    rows: list[tuple[str, bool, str]] = []
    for module_name, attribute_path in INTERRUPT_PATCH_POINTS:
        name = f"{module_name}:{attribute_path}"
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attribute_path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            rows.append((name, False, repr(exc)))
            continue
        present = callable(obj)
        detail = f"{attribute_path.rsplit('.', 1)[-1]}{inspect.signature(obj)}" if present else type(obj).__name__
        if attribute_path == "Trainer.train_epoch" and "step_callback" not in detail:
            present, detail = False, f"no step_callback parameter: {detail}"
        rows.append((name, present, detail))
    rows.append(_handler_attributes_row())
    return rows


def _handler_attributes_row() -> tuple[str, bool, str]:
    name = f"speculators.train.graceful_shutdown:GracefulShutdownHandler({', '.join(HANDLER_ATTRIBUTES)})"
    try:
        from speculators.train.graceful_shutdown import GracefulShutdownHandler

        handler = GracefulShutdownHandler()  # sets its fields only; installs nothing
    except (ImportError, TypeError) as exc:
        return name, False, repr(exc)
    missing = [a for a in HANDLER_ATTRIBUTES if not hasattr(handler, a)]
    return name, not missing, f"missing {missing}" if missing else "present"


@dataclasses.dataclass
class _Progress:
    """Where the trainer is: the epoch train_epoch runs, the global step it started at, whether a step is
    between its optimizer step and its end, and a stop signal held back until then."""

    epoch: int
    epoch_start_step: int
    epoch_done: bool = False
    in_step: bool = False
    pending: Callable[[], None] | None = None
    ranks_agree: bool = False  # several ranks, inside train_epoch: a stop signal waits for the ranks' agreement


_current: list[_Progress] = []  # the progress of the trainer in this process (at most one)
_handlers: list[Any] = []  # speculators' shutdown handler installed in this process (the last one)
_speculators_handler: list[Callable[..., None]] = []  # its own signal handler, before the wrap


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _any_rank_stopping(stopping: bool, device: Any) -> bool:
    """Whether any rank holds a stop signal: one all-reduce (MAX) of a flag, every rank at the same step's end."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1.0 if stopping else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def _progress_of(trainer: Any) -> _Progress:
    """The trainer's progress; before its first train_epoch, the point it resumed from (or the start)."""
    if _current:
        return _current[-1]
    epoch = int(getattr(trainer, "current_epoch", 0))
    return _Progress(epoch, int(trainer.global_step) - int(getattr(trainer, "_resume_local_step", 0)))


def _write_state(path: Path, record: dict[str, int]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def _wrap_restore(original: Callable[..., Any]) -> Callable[..., Any]:
    def restore(self: Any) -> None:
        original(self)
        if getattr(self, "_interrupted", False) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a duplicate must not kill the save it asked for

    return restore


def _wrap_train_epoch(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_epoch(self: Any, epoch: int, *, step_callback: Callable[[], None] | None = None) -> Any:
        # a resumed epoch starts with the steps speculators skips (mid-epoch resume) already done
        skipped = int(getattr(self, "_resume_local_step", 0)) if epoch == getattr(self, "current_epoch", epoch) else 0
        progress = _Progress(epoch, int(self.global_step) - skipped, ranks_agree=_world_size() > 1)
        _current[:] = [progress]

        def at_step_end() -> None:
            progress.in_step = False
            if step_callback is not None:
                step_callback()
            if progress.ranks_agree and _any_rank_stopping(progress.pending is not None, self.local_rank):
                if progress.pending is None:  # another rank was signalled (this one's signal may be on its way)
                    progress.pending = _stop_with_the_other_ranks()
            if progress.pending is not None:
                act, progress.pending = progress.pending, None
                act()  # speculators' handler: logs "Received SIGTERM", raises TrainingInterruptedError

        try:
            result = original(self, epoch, step_callback=at_step_end)
        finally:
            progress.in_step = False
            progress.ranks_agree = False  # outside the steps a signal acts at once, as with one process
        if progress.pending is not None:  # came after the last step's agreement
            act, progress.pending = progress.pending, None
            act()
        progress.epoch_done = True
        return result

    return train_epoch


def _wrap_optimizers_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def optimizers_step(self: Any) -> Any:
        if _current:
            _current[-1].in_step = True  # from here to the end of the step, a stop signal waits
        return original(self)

    return optimizers_step


def _wrap_handler(original: Callable[..., Any]) -> Callable[..., Any]:
    def handler(self: Any, signum: int, frame: Any) -> None:
        if os.getpid() != getattr(self, "_owner_pid", None):
            original(self, signum, frame)  # a forked DataLoader worker: speculators' handler ignores it
            return
        if getattr(self, _STOPPING, False):
            # a re-send (SLURM and the stage's launcher, torchrun): speculators ignores it too, but only inside its
            # lock, which the first signal's handler may hold right now (seen in a test: the trainer hung until
            # the stage killed it 125 s later, with no interrupt save). So it is ignored here, before the lock.
            return
        setattr(self, _STOPPING, True)
        progress = _current[-1] if _current else None
        if progress is not None and (progress.in_step or progress.ranks_agree):
            # no I/O here: a signal handler may interrupt a write to the same stream
            progress.pending = lambda: original(self, signum, frame)
            return
        original(self, signum, frame)

    return handler


def _stop_with_the_other_ranks() -> Callable[[], None]:
    """What a rank that got no stop signal does when another rank got one: what the signal would have done."""
    handler, act = _handlers[-1], _speculators_handler[0]
    setattr(handler, _STOPPING, True)  # its own signal, when it comes, is a re-send
    return lambda: act(handler, signal.SIGTERM, None)


def _wrap_install(original: Callable[..., Any]) -> Callable[..., Any]:
    def install(self: Any) -> None:
        original(self)
        _handlers[:] = [self]

    return install


def _wrap_maybe_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_save_checkpoint(self: Any, epoch: int | str, local_step: int = 0) -> Any:
        if epoch != INTERRUPTED:
            return original(self, epoch, local_step)
        folder = Path(self.checkpointer.path) / INTERRUPTED
        rank0 = int(getattr(self, "rank", 0)) == 0
        progress = _progress_of(self)
        record = interrupt_record(
            progress.epoch,
            int(self.global_step) - progress.epoch_start_step,
            int(self.global_step),
            epoch_done=progress.epoch_done,
        )
        if rank0 and folder.exists():
            shutil.rmtree(folder)  # an earlier launch's: never mix its files with this save's
        result = original(self, epoch, local_step)  # several ranks: rank 0 writes, every rank passes its barrier
        # on every rank (speculators' own log lines are rank 0's only): which ranks took part in the save
        log.info("rank %d: interrupt save done", int(getattr(self, "rank", 0)), extra={"override_rank0_filter": True})
        if rank0:
            _write_state(folder / STATE_FILE, record)
            log.info("interrupt checkpoint %s records %s", folder, record)
        return result

    return maybe_save_checkpoint


def apply_interrupt_patches() -> None:
    """Wrap speculators' trainer and shutdown handler as the module docstring says (idempotent)."""
    missing = [f"{name} ({detail})" for name, present, detail in interrupt_patch_points_present() if not present]
    if missing:
        raise RuntimeError(
            f"the trainer entry cannot make speculators' interrupt save resumable: {missing} changed. The installed "
            "speculators differs from 0.9.0; update eagle3_workflow/trainer/interrupt.py for it"
        )
    from speculators.train import graceful_shutdown, trainer

    if getattr(trainer.Trainer, _PATCHED_MARKER, False):
        return
    cls = trainer.Trainer
    cls.train_epoch = _wrap_train_epoch(cls.train_epoch)
    cls._optimizers_step = _wrap_optimizers_step(cls._optimizers_step)
    cls.maybe_save_checkpoint = _wrap_maybe_save_checkpoint(cls.maybe_save_checkpoint)
    handler_cls = graceful_shutdown.GracefulShutdownHandler
    _speculators_handler[:] = [handler_cls._handler]
    handler_cls._handler = _wrap_handler(handler_cls._handler)
    handler_cls.install = _wrap_install(handler_cls.install)
    handler_cls.restore = _wrap_restore(handler_cls.restore)
    setattr(cls, _PATCHED_MARKER, True)
