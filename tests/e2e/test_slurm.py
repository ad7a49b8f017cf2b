"""The tiny preset through `--profile profiles/slurm` on a real single-node SLURM (tests/slurm_cluster.py). The
profile's settings on their own: tests/integration/test_slurm_profile.py.

The cluster declares 8 GPUs as a generic resource; the run asks for 2 per extraction replica, and the test
reads the request back from slurmctld (`scontrol show job`) after the run: partition, GPUs, one node,
requeue. It reads back the job ids the slurm plugin logged as it submitted them, which the cluster keeps for its
lifetime: however long the run takes on a loaded machine, none is forgotten. Cluster tests skip (with the reason)
only where the daemons cannot start; any failure after that fails.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import NO_SITE_SETTINGS, REPO, rules_run, run_workflow, tiny_config
from slurm_cluster import SlurmCluster, SlurmUnavailable

PROFILE = REPO / "profiles" / "slurm"
EXTRACTION_GPUS = 2


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


# the slurm plugin's line for each job it submits (snakemake-executor-plugin-slurm 2.x)
SUBMITTED = re.compile(r"Job \d+ has been submitted with SLURM jobid (\d+)")


def submitted_job_ids(output: str) -> list[str]:
    """The SLURM job ids of a run, in submission order, as the plugin logged them when it submitted each job."""
    return SUBMITTED.findall(output)


def slurm_jobs_by_rule(cluster: SlurmCluster, job_ids: list[str]) -> dict[str, list[dict[str, str]]]:
    """The run's jobs as slurmctld records them, keyed by rule (the plugin's --comment is
    rule_<name>[_wildcards_<w>]). Every id the run submitted must still be known: the cluster keeps finished jobs
    for its lifetime (tests/slurm_cluster.py, MinJobAge), so how long the run took does not matter."""
    known = {job["JobId"]: job for job in cluster.jobs()}
    forgotten = [job_id for job_id in job_ids if job_id not in known]
    assert not forgotten, f"slurmctld no longer knows jobs {forgotten} of this run (MinJobAge in slurm_cluster.py)"
    by_rule: dict[str, list[dict[str, str]]] = {}
    for job_id in job_ids:
        comment = known[job_id].get("Comment", "")
        assert comment.startswith("rule_"), known[job_id]
        rule = comment[len("rule_") :].split("_wildcards_")[0]
        by_rule.setdefault(rule, []).append(known[job_id])
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
@pytest.mark.timeout(2700)  # a hang guard above the run's own (2400 s), so that one fails first, with its output
def test_tiny_run_through_slurm_profile(slurm_cluster, tmp_path):
    # every rule up to the trained draft, with less work in each than the tiny preset's (what a rule computes is
    # tests/e2e/test_e2e.py's): this test is about what SLURM is asked for and runs. It stops at train_draft: the
    # rules after it add no kind of job (evaluate_draft takes its resources from the same gpu_resources as
    # train_draft, checked below; summarize_run, package_draft and report are localrules like record_provenance,
    # which runs here), only their stage time and the plugin's polling (~65 s here, twice that on a slow day);
    # their planned SLURM resources: tests/integration/test_presets_dry_run.py
    config = tiny_config(
        "slurm",
        data={"max_samples": 64},
        extraction={"gpus_per_replica": EXTRACTION_GPUS},
        train={"epochs": 1},
        slurm={"cpu_partition": "cpu", "gpu_partition": "gpu", "mem_mb_gpu_job": 4000, "mem_mb_cpu_job": 4000},
    )
    workdir = tmp_path / "work"
    started = time.monotonic()
    proc = run_workflow(
        workdir,
        config,
        targets=["results/slurm/provenance.json", "results/slurm/draft"],
        extra=[
            "--profile",
            str(PROFILE),
            # this cluster has no accounts and no accounting database (docs/slurm.md)
            "--slurm-no-account",
            "--slurm-status-command",
            "squeue",
            # short jobs: poll soon (the cluster's MinJobAge >= 3 x 1 s keeps squeue reliable). The plugin adds 10 s
            # to its interval after each round in which no job finished (snakemake-executor-plugin-slurm's
            # check_active_jobs): from 5 s a 60 s job was seen at 80 s, from 1 s at 64 s, and a slow day's 130 s
            # job at 180 s against 156 s
            "--slurm-init-seconds-before-status-checks",
            "1",
        ],
        env={**NO_SITE_SETTINGS, **slurm_cluster.env},
        timeout=2400,
    )
    elapsed = time.monotonic() - started
    print(f"tiny preset through SLURM: {elapsed:.0f} s")

    job_ids = submitted_job_ids(proc.stdout + proc.stderr)
    assert job_ids, f"no SLURM job was submitted:\n{proc.stderr[-4000:]}"
    jobs = slurm_jobs_by_rule(slurm_cluster, job_ids)
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
    # a GPU-capable rule configured with 0 GPUs is a CPU job on the CPU partition, without a GPU request
    [training] = jobs["train_draft"]
    assert training["Partition"] == "cpu", training
    assert training.get("TresPerJob") in (None, "(null)"), training
    # localrules never reach SLURM
    assert "record_provenance" in rules_run(proc), "the localrule ran"
    assert "record_provenance" not in jobs, sorted(jobs)

    cluster_rules = {
        "build_tiny_target",
        "prepare_data",
        "check_api",
        "canary",
        "extract_hidden_states",
        "validate_hidden_states",
        "train_draft",
    }
    assert cluster_rules == set(jobs), f"never submitted: {sorted(cluster_rules - set(jobs))}"
    run_dir = workdir / "results" / "slurm"
    for artefact in (
        "provenance.json",
        "checks/canary.json",
        "hidden_states/validation.json",
        "draft/model.safetensors",
    ):
        assert (run_dir / artefact).exists(), artefact
    slurm_logs = list((workdir / "results" / "slurm_logs").rglob("*.log"))
    assert slurm_logs, "slurm-logdir/keep-successful-logs: no SLURM log under results/slurm_logs"
