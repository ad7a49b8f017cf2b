"""A full disk, recognised wherever it shows: an OSError of our own (ENOSPC, EDQUOT) or a line in a child's output
(vLLM's connector writes the hidden-state files in the server process, so there it is only a log line), and the
numbers a person needs then: which file system, how much is free now. No processes, no vLLM: the stage that failed
says what is safe and what to do (extraction/replica.py).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Python's OSError text, Rust's io::Error (safetensors' writer) and its ErrorKind names
DISK_FULL_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|\[Errno (?:28|122)\]|os error (?:28|122)|StorageFull|QuotaExceeded"
)
QUOTA_TEXT = re.compile(r"quota", re.IGNORECASE)


def is_disk_full(exc: BaseException) -> bool:
    """True for an OSError that says the file system (or the user's quota on it) has no room left."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def disk_full_line(text: str) -> str | None:
    """The first line of `text` that reports a full disk or an exceeded quota, else None."""
    return next((line.strip() for line in text.splitlines() if DISK_FULL_TEXT.search(line)), None)


@dataclasses.dataclass(frozen=True)
class DiskFullEvidence:
    """What could not be written, where, and whether a quota (not the file system) was the limit."""

    what: str
    folder: Path
    quota: bool


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """exc, then its causes and contexts (each once: chains can loop)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def disk_full_evidence(exc: BaseException, default_folder: Path, *, quoted_folder: Path) -> DiskFullEvidence | None:
    """The full disk behind `exc`, if any: an OSError ENOSPC/EDQUOT of our own in its chain (in the folder of the
    file it names, else `default_folder`), or an error message that quotes one (a child's log line: the child
    wrote into `quoted_folder`)."""
    for link in exception_chain(exc):
        if is_disk_full(link):
            assert isinstance(link, OSError)
            folder = Path(link.filename).parent if link.filename else default_folder
            where = f"writing {link.filename}" if link.filename else "a write"
            return DiskFullEvidence(f"{where} failed with {link!r}", folder, link.errno == errno.EDQUOT)
    for link in exception_chain(exc):
        line = disk_full_line(str(link))
        if line is not None:
            return DiskFullEvidence(line, quoted_folder, bool(QUOTA_TEXT.search(line)))
    return None


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a folder removed after the failure still has a disk)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds `path`."""
    path = existing_ancestor(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


@dataclasses.dataclass(frozen=True)
class FileSystemSpace:
    mount_point: Path
    free: int
    total: int


def space_of(path: Path) -> FileSystemSpace:
    """Free and total bytes, now, of the file system that holds `path`."""
    usage = shutil.disk_usage(existing_ancestor(path))
    return FileSystemSpace(mount_point(path), usage.free, usage.total)
