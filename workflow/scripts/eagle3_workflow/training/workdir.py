"""The resumable ``train_work/`` directory: its fingerprint (kept or cleared), the data directory speculators
reads, the vocabulary mapping (built once, then only read), and each launch's files (the checkpoints:
``checkpoints.py``).
numpy, torch, safetensors and speculators are imported only inside the functions that need them."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import ArtefactError, load, write
from eagle3_workflow.files.draft_artefacts import TrainingFingerprint
from eagle3_workflow.files.hidden_states import hs_file
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import TrainSettings
from eagle3_workflow.trainer.command import TrainPaths

log = logging.getLogger("eagle3.training")

# Train settings that may change between a kill and the rerun without invalidating the checkpoints
# (train.online: how the online server is sized and how failures are handled, not what the samples are)
RESUME_NEUTRAL_SETTINGS = {"gpus", "num_workers", "runtime_minutes", "checkpoint_freq", "disk_margin", "online"}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def training_fingerprint(
    settings: TrainSettings,
    *,
    target: Path,
    prepared: Path,
    token_freq: Path,
    validation: Path,
    files_dir: Path,
    rows: int,
    target_layer_ids: Sequence[int],
) -> TrainingFingerprint:
    """What the checkpoints depend on, cheap to compute at any scale.

    Content hashes of the small inputs (so an upstream rerun that reproduces the same data keeps the checkpoints),
    of a few hidden-state files (they change when the target's weights do, which are too large to hash), and the
    names and sizes of the target's weight files.
    """

    relevant = settings.model_dump(mode="json", exclude=RESUME_NEUTRAL_SETTINGS)
    config_path = target / "config.json"
    weights = sorted(p for p in target.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    samples = [hs_file(files_dir, row) for row in sorted({0, 1, rows // 2, rows - 1}) if row >= 0]
    return TrainingFingerprint(
        settings=relevant,
        target_layer_ids=list(target_layer_ids),
        target_config_sha256=sha256_file(config_path) if config_path.exists() else None,
        target_weight_files={p.name: p.stat().st_size for p in weights},
        prepared_sha256={p.name: sha256_file(p) for p in sorted(prepared.iterdir()) if p.is_file()},
        token_freq_sha256=sha256_file(token_freq),
        validation_sha256=sha256_file(validation),
        hidden_state_samples_sha256={p.name: sha256_file(p) for p in samples if p.exists()},
        # speculators 0.9.0 has no __version__: the installed distribution's metadata says it
        speculators_version=importlib.metadata.version("speculators"),
    )


def _differences(old: TrainingFingerprint, new: TrainingFingerprint) -> list[str]:
    before, after = old.model_dump(), new.model_dump()
    return sorted(k for k in after if before[k] != after[k])


def reconcile_work_dir(work_dir: Path, fingerprint: TrainingFingerprint) -> bool:
    """Keep ``work_dir`` when it was made from the same inputs, else clear it. True when it was kept."""
    marker = work_dir / "fingerprint.json"
    if marker.exists():
        try:
            previous = load(TrainingFingerprint, marker)
        except ArtefactError as exc:  # unreadable, or written by another version of the workflow
            log.warning("train_work %s: its fingerprint cannot be compared, clearing it (%s)", work_dir, exc)
            previous = None
        if previous == fingerprint:
            return True
        if previous is not None:
            log.warning(
                "train_work %s was made from other inputs (differs in: %s): clearing it, training starts from scratch",
                work_dir,
                ", ".join(_differences(previous, fingerprint)),
            )
        shutil.rmtree(work_dir)
    elif work_dir.exists() and any(work_dir.iterdir()):
        log.warning("train_work %s has no fingerprint.json: clearing it, training starts from scratch", work_dir)
        shutil.rmtree(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    write(marker, fingerprint)
    return False


def _relative_symlink(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(target.resolve(), link.parent.resolve()))


def stage_training_data(data_dir: Path, *, prepared: Path, token_freq: Path, files_dir: Path | None) -> None:
    """The data directory speculators reads: the prepared dataset's files, token_freq.pt and hidden_states/ (None:
    online training, where no sample is on disk and the trainer generates each).

    Symlinks only (relative, so the results tree can move); rebuilt each time, so a changed shard list never
    leaves a stale link. Regular files here (the vocab mapping) are kept.
    """
    if files_dir is not None and not files_dir.is_dir():
        raise StageError(f"hidden-state files directory {files_dir} does not exist; run extract_hidden_states first")
    data_dir.mkdir(parents=True, exist_ok=True)
    for entry in data_dir.iterdir():
        if entry.is_symlink():
            entry.unlink()
    for item in sorted(prepared.iterdir()):
        _relative_symlink(data_dir / item.name, item)
    _relative_symlink(data_dir / "token_freq.pt", token_freq)
    if files_dir is not None:
        _relative_symlink(data_dir / "hidden_states", files_dir)


@functools.cache
def vocab_mapping_module() -> Any:
    """speculators.train.vocab_mapping, its own code, loaded without the speculators package's __init__ (which
    imports the trainer, the models and vLLM's config classes: 9.0 s against 4.3 s on the 2-core VM, 2026-12-03;
    train_draft pays it once more in the trainer's process). The module imports only torch, datasets, tqdm and
    transformers; should a speculators release make it import its package, the normal import is used."""
    import importlib.util
    import sys

    loaded = sys.modules.get("speculators.train.vocab_mapping")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("speculators")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "train" / "vocab_mapping.py" if locations else None
    source = path.read_text() if path is not None and path.is_file() else ""
    if path is not None and source and "from speculators" not in source and "import speculators" not in source:
        file_spec = importlib.util.spec_from_file_location("eagle3_speculators_vocab_mapping", path)
        if file_spec is not None and file_spec.loader is not None:
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            return module
    import speculators.train.vocab_mapping as module

    return module


def target_vocab_size(target: Path, trust_remote_code: bool) -> int:
    get_target_vocab_size = vocab_mapping_module().get_target_vocab_size
    return int(get_target_vocab_size(None, str(target), trust_remote_code=trust_remote_code))


def ensure_vocab_mapping(paths: TrainPaths, *, token_freq: Path, draft_vocab_size: int, vocab_size: int) -> bool:
    """Build d2t/t2d once with speculators' own function; afterwards only check them. True when built now."""
    import numpy as np
    import torch

    if paths.d2t.exists() and paths.t2d.exists():
        d2t, t2d = np.load(paths.d2t), np.load(paths.t2d)
        if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,) or int(t2d.sum()) != draft_vocab_size:
            raise StageError(
                f"the vocab mapping in {paths.data_dir} has d2t {d2t.shape}, t2d {t2d.shape} with {int(t2d.sum())} "
                f"selected, but draft_vocab_size={draft_vocab_size} and the target vocabulary has {vocab_size} "
                f"tokens; delete {paths.data_dir.parent} to start this training afresh"
            )
        return False
    build_vocab_mappings_from_distribution = vocab_mapping_module().build_vocab_mappings_from_distribution
    if draft_vocab_size > vocab_size:
        raise StageError(
            f"train.draft_vocab_size={draft_vocab_size} exceeds the target vocabulary ({vocab_size} tokens); set it "
            f"to at most {vocab_size}"
        )
    frequencies = torch.load(token_freq, weights_only=True)
    if not isinstance(frequencies, dict) or not frequencies:
        raise StageError(f"{token_freq} holds no token frequencies ({type(frequencies).__name__}); rerun prepare_data")
    d2t, t2d = build_vocab_mappings_from_distribution(frequencies, draft_vocab_size, vocab_size)
    covered = sum(1 for t in frequencies if t < vocab_size and bool(t2d[t]))
    log.info(
        "vocab mapping: %d draft tokens cover %d of %d distinct assistant tokens (%.1f%% of assistant token "
        "occurrences)",
        draft_vocab_size,
        covered,
        len(frequencies),
        100.0 * sum(c for t, c in frequencies.items() if t < vocab_size and bool(t2d[t])) / sum(frequencies.values()),
    )
    for path, array in ((paths.d2t, d2t.numpy()), (paths.t2d, t2d.numpy())):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npy")
        os.close(fd)
        np.save(tmp, array)
        os.replace(tmp, path)
    return True


def attempt_files(logs_dir: Path, attempt: int) -> tuple[Path, Path]:
    """(trainer output log, metrics JSONL) of one launch."""
    return logs_dir / f"trainer-attempt-{attempt:02d}.log", logs_dir / f"metrics-attempt-{attempt:02d}.jsonl"
