"""profiles/slurm: its settings, where site settings come from, `make install-profile`, and the tiny preset
through `--profile profiles/slurm` on a real single-node SLURM (tests/slurm_cluster.py).

The cluster declares 8 GPUs as a generic resource; the run asks for 2 per extraction replica, and the test
reads the request back from slurmctld (`scontrol show job`) after the run: partition, GPUs, one node,
requeue. Cluster tests skip (with the reason) only where the daemons cannot start; any failure after that
fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_workflow, tiny_config
from slurm_cluster import SlurmCluster, SlurmUnavailable

PROFILE = REPO / "profiles" / "slurm"
EXTRACTION_GPUS = 2
# Site settings a developer may have exported or written to an installed profile's local-overrides.yaml must
# not leak into the test: every SNAKEMAKE_SLURM_* the profile reads is pinned (empty = unset).
SITE_VARIABLES = ("ACCOUNT", "NO_ACCOUNT", "CPU_PARTITION", "GPU_PARTITION", "GPU_MODEL", "QOS", "STATUS_COMMAND")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    try:
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as e:
        pytest.skip(f"no local SLURM: {e}")
    yield cluster
    cluster.stop()
    leftover = {name: proc.pid for name, proc in cluster.processes.items() if proc.poll() is None}
    assert not leftover, f"daemons still running after stop(): {leftover}"


def parse_profile(env: dict[str, str]) -> dict:
    """profiles/slurm/config.yaml as Snakemake reads it (YTE rendered), in a subprocess: rendering exports site
    settings to the environment, which must not leak into the test process."""
    code = (
        "import json, sys\n"
        "from snakemake.profiles import ProfileConfigFileParser\n"
        "with open(sys.argv[1]) as f:\n"
        "    print(json.dumps(dict(ProfileConfigFileParser().parse(f))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(PROFILE / "config.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def default_resources(profile: dict) -> dict[str, str]:
    return dict(item.split("=", 1) for item in profile.get("default-resources", []))


def blank_site(tmp_path: Path) -> dict[str, str]:
    empty_overrides = tmp_path / "no-local-overrides.yaml"
    empty_overrides.write_text("{}\n")
    return {
        **{f"SNAKEMAKE_SLURM_{name}": "" for name in SITE_VARIABLES},
        "SNAKEMAKE_SLURM_OVERRIDES": str(empty_overrides),
    }


def test_profile_settings(tmp_path):
    profile = parse_profile(blank_site(tmp_path))
    assert profile["executor"] == "slurm"
    assert int(profile["retries"]) >= 1
    assert profile["slurm-requeue"] == "True"
    assert profile["slurm-logdir"].startswith("results/")
    assert profile["slurm-keep-successful-logs"] == "True"
    resources = default_resources(profile)
    assert "cpus_per_task" not in resources, "cpus_per_task in default-resources overrides every rule's threads"
    assert "attempt" in resources["runtime"], "runtime must grow with the retry attempt"
    assert resources["nodes"] == "1"
    # nothing site-specific unless the site says so
    assert "slurm_account" not in resources and "slurm_partition" not in resources
    assert "slurm-status-command" not in profile and "slurm-no-account" not in profile


def test_profile_site_settings_from_file_and_environment(tmp_path):
    overrides = tmp_path / "local-overrides.yaml"
    overrides.write_text("account: proj-file\ncpu_partition: cpu-file\nstatus_command: squeue\nqos: high\n")
    env = {**blank_site(tmp_path), "SNAKEMAKE_SLURM_OVERRIDES": str(overrides)}
    profile = parse_profile(env)
    resources = default_resources(profile)
    assert resources["slurm_account"] == "'proj-file'"
    assert resources["slurm_partition"] == "'cpu-file'"
    assert profile["slurm-status-command"] == "squeue"
    assert profile["slurm-qos"] == "high"
    # the environment wins over the file
    profile = parse_profile({**env, "SNAKEMAKE_SLURM_ACCOUNT": "proj-env"})
    assert default_resources(profile)["slurm_account"] == "'proj-env'"
    # clusters without accounts
    profile = parse_profile({**env, "SNAKEMAKE_SLURM_NO_ACCOUNT": "true"})
    assert profile["slurm-no-account"] == "True"
    assert "slurm_account" not in default_resources(profile)


def test_profile_rejects_unknown_override_keys(tmp_path):
    overrides = tmp_path / "local-overrides.yaml"
    overrides.write_text("acount: typo\n")
    code = (
        "import sys\n"
        "from snakemake.profiles import ProfileConfigFileParser\n"
        "ProfileConfigFileParser().parse(open(sys.argv[1]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(PROFILE / "config.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, **blank_site(tmp_path), "SNAKEMAKE_SLURM_OVERRIDES": str(overrides)},
        timeout=60,
    )
    assert proc.returncode != 0
    assert "unknown keys ['acount']" in proc.stderr


def test_install_profile_makes_profile_slurm_work_as_typed(tmp_path):
    """`make install-profile` links $XDG_CONFIG_HOME/snakemake/slurm, where `--profile slurm` looks."""
    config_home = tmp_path / "config-home"
    env = {**os.environ, **blank_site(tmp_path), "XDG_CONFIG_HOME": str(config_home)}
    subprocess.run(["make", "-C", str(REPO), "install-profile"], check=True, env=env, capture_output=True)
    link = config_home / "snakemake" / "slurm"
    assert link.is_symlink() and link.resolve() == PROFILE.resolve()
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "snakemake"),
            "-s",
            str(REPO / "Snakefile"),
            "-n",
            "--profile",
            "slurm",
            "--configfile",
            str(REPO / "config" / "presets" / "tiny.yaml"),
        ],
        cwd=workdir,
        env={**env, "SNAKEMAKE_SLURM_CPU_PARTITION": "from-env"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the profile was read: its default-resources (nodes=1, the site partition) are in the plan
    assert "nodes=1" in proc.stdout + proc.stderr
    assert "slurm_partition=from-env" in proc.stdout + proc.stderr


def slurm_jobs_by_rule(cluster: SlurmCluster) -> dict[str, list[dict[str, str]]]:
    """Jobs snakemake submitted, keyed by rule (the plugin's --comment is rule_<name>[_wildcards_<w>])."""
    by_rule: dict[str, list[dict[str, str]]] = {}
    for job in cluster.jobs():
        comment = job.get("Comment", "")
        if comment.startswith("rule_"):
            rule = comment[len("rule_") :].split("_wildcards_")[0]
            by_rule.setdefault(rule, []).append(job)
    return by_rule


@pytest.mark.slurm
def test_cluster_schedules_declared_gpus(slurm_cluster, tmp_path):
    """The GRES declaration works: a --gpus=2 job runs on the gpu partition and sees 2 GPU ids."""
    out = tmp_path / "job.out"
    job_id = slurm_cluster.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "gpu",
            "--gpus=2",
            "--nodes=1",
            "--mem=100",
            "-t",
            "2",
            "-o",
            str(out),
            "--wrap",
            "echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES",
        ]
    ).stdout.strip()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = next(j for j in slurm_cluster.jobs() if j["JobId"] == job_id)
        if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.5)
    assert job["JobState"] == "COMPLETED", job
    assert job["TresPerJob"] == "gres:gpu:2", job
    assert out.read_text().strip() == "CUDA_VISIBLE_DEVICES=0,1"


@pytest.mark.slurm
@pytest.mark.slow
def test_tiny_run_through_slurm_profile(slurm_cluster, tmp_path):
    config = tiny_config(
        "slurm",
        extraction={"gpus_per_replica": EXTRACTION_GPUS},
        slurm={"cpu_partition": "cpu", "gpu_partition": "gpu", "mem_mb_gpu_job": 4000, "mem_mb_cpu_job": 4000},
    )
    workdir = tmp_path / "work"
    started = time.monotonic()
    proc = run_workflow(
        workdir,
        config,
        extra=[
            "--profile",
            str(PROFILE),
            # this cluster has no accounts and no accounting database (docs/slurm.md)
            "--slurm-no-account",
            "--slurm-status-command",
            "squeue",
            # short jobs: poll soon (MinJobAge=600 >= 3 x 5 s keeps squeue reliable)
            "--slurm-init-seconds-before-status-checks",
            "5",
        ],
        env={**blank_site(tmp_path), **slurm_cluster.env},
        timeout=2400,
    )
    elapsed = time.monotonic() - started
    print(f"tiny preset through SLURM: {elapsed:.0f} s")

    jobs = slurm_jobs_by_rule(slurm_cluster)
    assert jobs, f"no SLURM job was submitted:\n{proc.stderr[-4000:]}"
    for rule, rule_jobs in jobs.items():
        for job in rule_jobs:
            assert job["JobState"] == "COMPLETED", (rule, job)
            assert job["NumNodes"] == "1", (rule, job)
            assert job["Requeue"] == "1", (rule, job)  # slurm-requeue: true in the profile

    # the extraction replica asked for exactly the GPUs its config says, on the GPU partition, one node
    [extraction] = jobs["extract_hidden_states"]
    assert extraction["TresPerJob"] == f"gres:gpu:{EXTRACTION_GPUS}", extraction
    assert extraction["Partition"] == "gpu", extraction
    [canary] = jobs["canary"]
    assert canary["TresPerJob"] == f"gres:gpu:{EXTRACTION_GPUS}", canary
    # GPU-capable rules configured with 0 GPUs are CPU jobs on the CPU partition, without a GPU request
    for rule in ("train_draft", "evaluate_draft"):
        for job in jobs.get(rule, []):
            assert job["Partition"] == "cpu", job
            assert job.get("TresPerJob") in (None, "(null)"), job
    # localrules never reach SLURM
    assert not {"record_provenance", "summarize_run", "report"} & set(jobs), sorted(jobs)

    cluster_rules = {
        "build_tiny_target",
        "prepare_data",
        "check_api",
        "canary",
        "extract_hidden_states",
        "validate_hidden_states",
        "train_draft",
        "evaluate_draft",
    }
    assert cluster_rules <= set(jobs), f"never submitted: {sorted(cluster_rules - set(jobs))}"
    run_dir = workdir / "results" / "slurm"
    for artefact in (
        "provenance.json",
        "checks/canary.json",
        "hidden_states/validation.json",
        "eval/acceptance.json",
        "report.html",
    ):
        assert (run_dir / artefact).exists(), artefact
    slurm_logs = list((workdir / "results" / "slurm_logs").rglob("*.log"))
    assert slurm_logs, "slurm-logdir/keep-successful-logs: no SLURM log under results/slurm_logs"
