"""What identifies a model folder's bytes: the measurement keys (resume.keyed_run) and the untrained draft's recipe
(baseline) both use it. Pure: hashlib and the file system only."""

from __future__ import annotations

import hashlib
from pathlib import Path

# files up to this size are hashed by content (drafts, a small target); larger ones by size and mtime, so a larger
# file that is written again, even with the same bytes, changes its folder's fingerprint (baseline keeps the
# untrained draft's files for that reason)
CONTENT_HASH_LIMIT = 1 << 30


def model_fingerprint(folder: Path, *, leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """What identifies a model folder's weights and config: a rebuilt draft with other weights changes it.
    `leave_out`: file names not counted (the untrained draft's own recipe, which records this fingerprint)."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in leave_out):
        stat = path.stat()
        if stat.st_size <= CONTENT_HASH_LIMIT:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
            out[path.name] = digest.hexdigest()
        else:
            out[path.name] = f"{stat.st_size}:{stat.st_mtime_ns}"
    return out
