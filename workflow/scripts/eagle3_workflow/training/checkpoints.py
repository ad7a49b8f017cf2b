"""speculators' checkpoints in ``train_work/checkpoints/``: which saved state is the newest complete one, what the
rerun does with it, and the sentence a stop logs. Pure functions over what a scan found (``plan_resume``,
``rerun_outlook``) and thin adapters that read or change the folder (``scan_checkpoints``, ``prepare_resume``,
``outlook_on_disk``).

What speculators 0.9.0 writes there (``Trainer.maybe_save_checkpoint``):

- ``<epoch>/`` at the end of an epoch and, with ``checkpoint_freq`` < 1, during it (each save of the epoch rewrites
  the same folder): ``config.json``, ``model.safetensors``, ``optimizer_state_dict.pt``, ``scheduler_state_dict.pt``,
  then ``training_state.json`` last (``epoch``, ``local_step``: steps done in the epoch, 0 = the epoch finished,
  ``global_step``: steps done in all);
- ``interrupted/`` on SIGTERM/SIGINT: the same files without ``training_state.json``; the trainer entry
  (``trainer.interrupt``) writes one there after the save, last.

On start speculators resumes from the highest-numbered folder without checking it, and ignores ``interrupted/``. So
before each launch ``prepare_resume`` removes what must not be resumed from (half-written folders, each with a
log line saying why) and, when ``interrupted/`` holds the newest state by its recorded global step, moves it to
``<epoch>/`` (what speculators' own message advises by hand), where speculators resumes from it mid-epoch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import zipfile
from collections.abc import Sequence
from pathlib import Path

from eagle3_workflow.files.draft_artefacts import CheckpointInfo
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.interrupt import INTERRUPTED, STATE_FILE

log = logging.getLogger("eagle3.training")

REQUIRED_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt")
# written before training_state.json by every save (the scheduler's only when there is a scheduler)
WRITTEN_BEFORE_STATE = (*REQUIRED_FILES, "scheduler_state_dict.pt")


@dataclasses.dataclass(frozen=True)
class FoundCheckpoint:
    """One folder of checkpoints/: the state its training_state.json records, or why it cannot be resumed from."""

    name: str  # "0", "1", ... or "interrupted"
    state: CheckpointInfo | None
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """The newest complete state, the folders to remove first (name, why) and, when the newest is
    ``interrupted/``, the numbered folder it moves to."""

    newest: FoundCheckpoint | None
    remove: tuple[tuple[str, str], ...] = ()
    promote_to: str | None = None


# ------------------------------------------------------------------------------------------------------ pure


def _progress(found: FoundCheckpoint) -> tuple[int, bool]:
    assert found.state is not None
    return found.state.global_step, found.name != INTERRUPTED  # a tie: the numbered folder, which needs no move


def _why_remove(found: FoundCheckpoint, newest: FoundCheckpoint | None) -> str | None:
    if found.state is None:
        return found.problem or "unreadable"
    if found.state.global_step <= 0:
        return "it holds no trained step"
    assert newest is not None and newest.state is not None  # found is usable, so there is a newest
    steps = f"global step {found.state.global_step} against {newest.state.global_step}"
    if found.name == INTERRUPTED:
        return f"it is not newer than {newest.name}/ ({steps})"
    if int(found.name) > newest.state.epoch:
        return (
            f"it is older than {newest.name}/ ({steps}) but numbered after it, and speculators resumes from the "
            "highest number"
        )
    if newest.name == INTERRUPTED and int(found.name) == newest.state.epoch:
        return f"{INTERRUPTED}/ is newer ({steps}) and takes its place"
    return None


def plan_resume(found: Sequence[FoundCheckpoint]) -> ResumePlan:
    """The newest state by its recorded global step (never by folder name), what to remove so that speculators
    resumes from exactly that state, and where ``interrupted/`` goes when it is the newest."""
    usable = [f for f in found if f.state is not None and f.state.global_step > 0]
    newest = max(usable, key=_progress, default=None)
    remove = tuple((f.name, why) for f in found if f is not newest and (why := _why_remove(f, newest)) is not None)
    promote_to = str(newest.state.epoch) if newest is not None and newest.name == INTERRUPTED else None
    return ResumePlan(newest, remove, promote_to)


def saved_at(state: CheckpointInfo) -> str:
    """Where training was when a state was saved."""
    if state.local_step == 0:
        return f"the end of epoch {state.epoch} (global step {state.global_step})"
    return f"epoch {state.epoch} step {state.local_step} (global step {state.global_step})"


def resume_point(state: CheckpointInfo) -> str:
    """Where speculators goes on from a state: the same step of a mid-epoch state, the next epoch after an end."""
    if state.local_step == 0:
        return f"the start of epoch {state.epoch + 1} (global step {state.global_step})"
    return f"epoch {state.epoch} step {state.local_step} (global step {state.global_step})"


def _interrupt_part(found: Sequence[FoundCheckpoint], plan: ResumePlan, label: str) -> str:
    interrupted = next((f for f in found if f.name == INTERRUPTED), None)
    if interrupted is None:
        return f"speculators saved no {label}/{INTERRUPTED}"
    if interrupted.state is None:
        return f"{label}/{INTERRUPTED} is incomplete and is ignored ({interrupted.problem})"
    if interrupted is plan.newest:
        return f"training was at {saved_at(interrupted.state)}; speculators saved {label}/{INTERRUPTED}"
    if plan.newest is None:
        return f"speculators saved {label}/{INTERRUPTED} before any step was trained"
    return (
        f"speculators saved {label}/{INTERRUPTED} at {saved_at(interrupted.state)}, no newer than "
        f"{label}/{plan.newest.name}"
    )


def rerun_outlook(
    found: Sequence[FoundCheckpoint],
    *,
    epochs: int | None,
    label: str = "checkpoints",
    last_logged: tuple[int, int] | None = None,
) -> str:
    """What a stop left and what the rerun will do, from the folders found. ``last_logged``: (epoch, steps done)
    of the last training step the metrics recorded, to say how many steps the rerun trains again."""
    plan = plan_resume(found)
    said = _interrupt_part(found, plan, label)
    newest = plan.newest
    if newest is None or newest.state is None:
        return f"{said}; the rerun starts training from scratch"
    state = newest.state
    folder = plan.promote_to or newest.name
    if epochs is not None and state.ends_training(epochs):
        return f"{said}; all {epochs} epochs are trained: the rerun publishes {label}/{folder} without training"
    source = "" if newest.name == INTERRUPTED else f"{label}/{folder} at "
    redone = ""
    if last_logged is not None and last_logged[1] > state.global_step:
        redone = f" ({last_logged[1] - state.global_step} steps logged up to epoch {last_logged[0]} are trained again)"
    return f"{said}; the rerun resumes from {source}{resume_point(state)}{redone}"


# ------------------------------------------------------------------------------------------------------ adapters


def _state_of(directory: Path) -> tuple[CheckpointInfo | None, str | None]:
    path = directory / STATE_FILE
    if not path.exists():
        return None, f"no {STATE_FILE}: the save did not finish"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        info = CheckpointInfo(
            epoch=int(raw["epoch"]),
            local_step=int(raw["local_step"]),
            global_step=int(raw["global_step"]),
            path=str(directory),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{STATE_FILE} is unreadable: {exc!r}"
    if directory.name != INTERRUPTED and info.epoch != int(directory.name):
        return None, f"its {STATE_FILE} records epoch {info.epoch}, not {directory.name}"
    return info, None


def _files_problem(directory: Path) -> str | None:
    """What is missing, cut short or newer than training_state.json (a later save into the folder cut short)."""
    from safetensors import SafetensorError, safe_open

    for name in REQUIRED_FILES:
        if not (directory / name).exists():
            return f"no {name}"
    state = directory / STATE_FILE
    if state.exists():
        written = state.stat().st_mtime_ns
        for name in WRITTEN_BEFORE_STATE:
            if (directory / name).exists() and (directory / name).stat().st_mtime_ns > written:
                return f"{name} is newer than {STATE_FILE}: a later save into this folder did not finish"
    try:
        with safe_open(directory / "model.safetensors", framework="pt") as handle:
            handle.keys()
        for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
            if (directory / name).exists():
                with zipfile.ZipFile(directory / name) as archive:
                    archive.namelist()
    except (OSError, ValueError, zipfile.BadZipFile, SafetensorError) as exc:
        return f"unreadable: {exc!r}"
    return None


def read_checkpoint(directory: Path) -> FoundCheckpoint:
    """One checkpoint folder as found: complete with its recorded state, or why not."""
    problem = _files_problem(directory)
    if problem is not None:
        return FoundCheckpoint(directory.name, None, problem)
    state, problem = _state_of(directory)
    return FoundCheckpoint(directory.name, state, problem)


def scan_checkpoints(save_dir: Path) -> list[FoundCheckpoint]:
    """The numbered folders (in order) and ``interrupted/`` of ``save_dir``; descriptive symlinks are skipped."""
    if not save_dir.is_dir():
        return []
    folders = [
        d
        for d in save_dir.iterdir()
        if d.is_dir() and not d.is_symlink() and (d.name.isdigit() or d.name == INTERRUPTED)
    ]
    folders.sort(key=lambda d: (d.name == INTERRUPTED, int(d.name) if d.name.isdigit() else 0))
    return [read_checkpoint(d) for d in folders]


def latest_checkpoint(save_dir: Path) -> CheckpointInfo | None:
    """The newest complete numbered checkpoint (the one speculators' own saves end training with)."""
    numbered = [f for f in scan_checkpoints(save_dir) if f.name != INTERRUPTED and f.state is not None]
    return max(numbered, key=_progress).state if numbered else None


def _relink(save_dir: Path, state: CheckpointInfo) -> None:
    """speculators' descriptive link for a folder (``epoch0_step37 -> 0``), redone for the moved state."""
    for old in save_dir.glob(f"epoch{state.epoch}_*"):
        if old.is_symlink():
            old.unlink()
    suffix = f"step{state.local_step}" if state.local_step > 0 else "end"
    (save_dir / f"epoch{state.epoch}_{suffix}").symlink_to(str(state.epoch))


def _remove(path: Path, why: str) -> None:
    log.warning("ignoring checkpoint %s: %s; removing it", path, why)
    try:
        shutil.rmtree(path)
    except OSError as exc:
        raise StageError(
            f"cannot remove {path} ({exc!r}), which must not be resumed from ({why}); remove it by hand and rerun"
        ) from exc


def prepare_resume(save_dir: Path) -> CheckpointInfo | None:
    """Make speculators resume from the newest complete state in ``save_dir`` (see the module docstring); that
    state, where it now is, or None when there is none (training starts from scratch)."""
    plan = plan_resume(scan_checkpoints(save_dir))
    for name, why in plan.remove:
        _remove(save_dir / name, why)
    if plan.newest is None or plan.newest.state is None:
        return None
    state = plan.newest.state
    if plan.promote_to is not None:
        target = save_dir / plan.promote_to
        (save_dir / INTERRUPTED).rename(target)
        state = state.model_copy(update={"path": str(target)})
        _relink(save_dir, state)
        log.info(
            "%s holds the newest state (%s): moved to %s, where speculators resumes from it",
            save_dir / INTERRUPTED,
            saved_at(state),
            target,
        )
    return state


def last_logged_step(logs_dir: Path) -> tuple[int, int] | None:
    """(epoch, steps done) of the last training step in the launches' metric records, newest launch first."""
    from eagle3_workflow.training.metrics import read_metric_lines

    files = sorted(logs_dir.glob("metrics-attempt-*.jsonl"), key=lambda p: int(p.stem.rsplit("-", 1)[-1]))
    for path in reversed(files):
        for record in reversed(read_metric_lines(path)):
            metrics = record.get("metrics", {})
            if isinstance(metrics, dict) and "train" in metrics:
                return int(metrics["epoch"]), int(metrics["global_step"]) + 1
    return None


def outlook_on_disk(save_dir: Path, logs_dir: Path, epochs: int | None) -> str:
    """``rerun_outlook`` for what the checkpoints and metric records hold now (nothing is changed)."""
    return rerun_outlook(
        scan_checkpoints(save_dir), epochs=epochs, label=str(save_dir), last_logged=last_logged_step(logs_dir)
    )
