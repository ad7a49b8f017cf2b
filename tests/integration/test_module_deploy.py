"""Sharing the workflow as a Snakemake module: `snakedeploy deploy-workflow` into a fresh directory, a user
config there, a dry run through the deployed profiles/slurm, and the first real stages run from the deployed
module (scripts, schema and shipped data resolve from the module, outputs land in the user's directory).

The source is the repository as git sees it (tracked + untracked, not ignored: no .venv, no results), copied
to a temporary directory, standing in for the published repository. snakedeploy 0.17's local provider
writes `snakefile: "Snakefile"`, relative to the new workflow/ directory (wrong); a git host provider writes
`github("owner/repo", path="Snakefile", tag=...)`. The test points the module at the absolute path, as
docs/sharing.md tells users of a local checkout to do.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import NO_SITE_SETTINGS, REPO, TINY_PRESET, VENV_BIN, run_workflow

SNAKEDEPLOY = str(VENV_BIN / "snakedeploy")


def source_copy(dest: Path) -> Path:
    """The repository's files as git sees them, committed or not, without ignored paths."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the repository's git checkout to know which files belong to it")
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)
    return dest


def deployed_snakemake(deployed: Path, targets: list[str] | None = None, **options) -> subprocess.CompletedProcess:
    """`snakemake ... --configfile config/my_run.yaml` as the user types it in the deployed directory (no -s: the
    deployed workflow/Snakefile), with no site settings of whoever runs the tests."""
    options = {"timeout": 600, "env": NO_SITE_SETTINGS} | options
    return run_workflow(deployed, [Path("config/my_run.yaml")], targets, snakefile=None, **options)


@pytest.fixture
def deployed(tmp_path) -> Path:
    source = source_copy(tmp_path / "eagle3-workflow")
    dest = tmp_path / "my-drafts"
    deploy = [SNAKEDEPLOY, "deploy-workflow", str(source), str(dest), "--branch", "main", "--name", "eagle3"]
    proc = subprocess.run(deploy, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"snakedeploy failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )

    snakefile = dest / "workflow" / "Snakefile"
    text = snakefile.read_text()
    assert "module eagle3:" in text, text
    assert "use rule * from eagle3" in text, text
    # the local provider's relative path -> the source's absolute path (see the module docstring)
    text, count = re.subn(r'snakefile:\s*\n\s*"Snakefile"', f'snakefile:\n        "{source}/Snakefile"', text)
    assert count == 1, text
    snakefile.write_text(text)
    # snakedeploy copied config/ (presets, shipped data) and profiles/ for the user to edit
    assert (dest / "config" / "presets" / "kimi-k2.5-int4.yaml").exists()
    assert (dest / "profiles" / "slurm" / "config.yaml").exists()

    user_config = yaml.safe_load(TINY_PRESET.read_text())
    user_config["run"] = "deployed-tiny"
    user_config["extraction"]["replicas"] = 2
    (dest / "config" / "my_run.yaml").write_text(yaml.safe_dump(user_config))
    return dest


def test_deployed_module_dry_runs_with_user_config(deployed):
    proc = deployed_snakemake(deployed, extra=["-n", "--profile", "profiles/slurm"], cores=None)
    text = proc.stdout + proc.stderr
    assert re.search(r"^extract_hidden_states\s+2$", text, re.MULTILINE), text[-3000:]
    assert "results/deployed-tiny/report.html" in text
    assert "nodes=1" in text  # the deployed profile's default-resources


@pytest.mark.slow
def test_deployed_module_runs_first_stages(deployed):
    """Real jobs from the module: its scripts, schema and shared package run from the source checkout while
    outputs land in the user's directory. The user's copy of config/data is removed, so the data files the
    config names come from the module, through Snakemake's source cache (shipped() in common.smk)."""
    shutil.rmtree(deployed / "config" / "data")
    deployed_snakemake(deployed, ["results/deployed-tiny/data/manifest.json", "results/deployed-tiny/provenance.json"])
    run_dir = deployed / "results" / "deployed-tiny"
    assert (run_dir / "data" / "manifest.json").exists()
    assert (run_dir / "provenance.json").exists()
    assert (run_dir / "target" / "config.json").exists()
    manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
    source = manifest["sources"][0]
    assert source.endswith("config/data/tiny_conversations.jsonl"), manifest["sources"]
    assert not source.startswith(str(deployed)), "read from the user's directory, whose config/data was removed"
