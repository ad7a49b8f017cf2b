"""Files a reader sees whole and a group can read: the umask read without changing it, permissions restored where
safetensors and mkstemp make files private, an atomic text write and an atomically swapped-in folder."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from eagle3_workflow.files.disk import is_disk_full


def process_umask() -> int:
    """The umask, read without changing it (os.umask's read-by-setting races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(root: str | Path) -> None:
    """Give every file (and folder) under `root` the permissions a plain open() would have given it.

    safetensors >= 0.8 writes through a private temporary file, so every save_file / save_pretrained leaves
    model.safetensors 0600 whatever the umask; mkstemp/mkdtemp do the same. A target, draft or hidden-state
    file that only its writer can read breaks jobs that run as another user of the group.
    """
    umask = process_umask()
    root = Path(root)
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if path.is_symlink():
            continue
        allowed = (0o777 if path.is_dir() else 0o666) & ~umask
        mode = path.stat().st_mode & 0o7777
        if mode | allowed != mode:
            path.chmod(mode | allowed)


def write_text_atomic(path: str | Path, text: str, *, in_place_when_full: bool = False) -> None:
    """Write a text file so that a reader sees the old file or the whole new one, never a partial one.

    in_place_when_full: on a full disk (no room for the temporary file), overwrite the existing file in place
    instead (`overwrite_in_place`): for the last word of a small status file, which must not be lost to the very
    fault it reports.
    """
    try:
        _write_text_atomic(Path(path), text)
    except OSError as exc:
        if not (in_place_when_full and is_disk_full(exc) and Path(path).is_file()):
            raise
        overwrite_in_place(Path(path), text)


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~process_umask())  # mkstemp creates 0600; artefacts are meant to be read by others
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a failed write or close names no file: say which one it was
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def overwrite_in_place(path: Path, text: str) -> None:
    """Replace a small file's content within the blocks it already holds: nothing is allocated, so this works on a
    full disk where an atomic write cannot create its temporary file. Not atomic (a reader may see it half
    written for an instant); refuses (ENOSPC) a text longer than the space the file holds."""
    data = text.encode("utf-8")
    fd = os.open(path, os.O_WRONLY)
    try:
        held = os.fstat(fd).st_blocks * 512
        if len(data) > held:
            raise OSError(errno.ENOSPC, f"{len(data)} B do not fit in the {held} B the file holds", str(path))
        offset = 0
        while offset < len(data):
            written = os.pwrite(fd, data[offset:], offset)
            if written <= 0:
                raise OSError(errno.ENOSPC, f"wrote {offset} of {len(data)} B", str(path))
            offset += written
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


@contextlib.contextmanager
def published_directory(out_dir: str | Path) -> Iterator[Path]:
    """Fill a private staging folder beside out_dir, then swap it in whole: a reader (or a failed run) sees the
    old folder or the complete new one, never a half-written one. Files get the permissions the umask allows
    (mkdtemp and safetensors make them private; a draft is for others to serve)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        yield staging
        share_as_umask_allows(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
