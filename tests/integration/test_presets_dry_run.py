"""Published presets (config/presets/*.yaml other than tiny) through Snakemake: complete alone with --configfile,
and a dry run through profiles/slurm whose plan asks SLURM for the GPUs and partitions the preset and the site
settings say (the presets as files: tests/unit/test_presets.py). Nothing is downloaded: the target is a directory
holding only config.json, the data the tiny conversations file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from conftest import NO_SITE_SETTINGS, REPO, TINY_DATA, run_workflow
from published_presets import GPU_SMOLLM2, PRESETS, TargetShape, load_preset, preset_path, with_defaults

DEFAULTS = REPO / "config" / "config.yaml"
PROFILE = REPO / "profiles" / "slurm"
SITE_GPU_PARTITION = "site-gpu"
SITE_CPU_PARTITION = "site-cpu"
# rules with no GPU at all; they take the site CPU partition from the profile's default-resources
CPU_RULES = ("prepare_data", "check_api", "validate_hidden_states")


@dataclasses.dataclass
class PlannedJob:
    rule: str
    wildcards: str
    resources: dict[str, str]
    threads: int = 1


def parse_dry_run_plan(text: str) -> list[PlannedJob]:
    """The jobs of `snakemake -n` output: rule name, wildcards, and the resources line as a dict."""
    jobs: list[PlannedJob] = []
    for line in text.splitlines():
        if line.startswith(("rule ", "localrule ")) and line.rstrip().endswith(":"):
            jobs.append(PlannedJob(rule=line.split()[1].rstrip(":"), wildcards="", resources={}))
        elif jobs and line.startswith("    wildcards: "):
            jobs[-1].wildcards = line.split(": ", 1)[1].strip()
        elif jobs and line.startswith("    threads: "):
            jobs[-1].threads = int(line.split(": ", 1)[1])
        elif jobs and line.startswith("    resources: "):
            for item in line.split(": ", 1)[1].split(", "):
                key, _, value = item.partition("=")
                jobs[-1].resources[key.strip()] = value.strip()
    return jobs


def fake_target(tmp_path: Path, shape: TargetShape) -> Path:
    """A model directory holding only config.json: enough for planning, nothing to download."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": shape.num_layers, "hidden_size": shape.hidden_size})
    )
    return model


def dry_run(tmp_path: Path, configfiles: list[Path], env: dict[str, str]) -> str:
    """`snakemake -n --profile profiles/slurm` on the config files, site settings only from `env`: its output."""
    proc = run_workflow(
        tmp_path / "work",
        configfiles,
        extra=["-n", "--profile", str(PROFILE)],
        cores=None,
        timeout=300,
        env={**NO_SITE_SETTINGS, **env},
    )
    return proc.stdout + proc.stderr


def user_paths_file(tmp_path: Path, shape: TargetShape, extra: dict | None = None) -> Path:
    """What a user adds on top of a published preset: where the model and the data are."""
    paths = {
        "target": {"path": str(fake_target(tmp_path, shape))},
        "data": {"sources": [{"path": str(TINY_DATA), "format": "sharegpt"}]},
        **(extra or {}),
    }
    path = tmp_path / "my_paths.yaml"
    path.write_text(yaml.safe_dump(paths))
    return path


def test_a_configfile_run_takes_nothing_from_the_tiny_defaults(tmp_path):
    """With --configfile, config/config.yaml is not loaded: the run's config is the user's file plus the schema's
    defaults (read back from the provenance the real rule records), so no tiny value can leak into a real run."""
    user = {
        "run": "no-leak",
        "target": {"path": str(tmp_path / "model")},
        "data": {"sources": [{"path": str(TINY_DATA), "format": "sharegpt"}]},
    }
    config_path = tmp_path / "user.yaml"
    config_path.write_text(yaml.safe_dump(user))
    tiny_defaults = yaml.safe_load(DEFAULTS.read_text())
    run_workflow(tmp_path, [config_path], targets=["results/no-leak/provenance.json"], cores=1, timeout=300)
    recorded = json.loads((tmp_path / "results" / "no-leak" / "provenance.json").read_text())["config"]
    assert recorded == with_defaults(user)
    assert recorded["data"]["max_samples"] != tiny_defaults["data"]["max_samples"], "the tiny cap leaked"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_dry_run_plans_gpus_and_partitions(name, tmp_path):
    shape = PRESETS[name]
    preset = with_defaults(load_preset(name))
    text = dry_run(
        tmp_path,
        [preset_path(name), user_paths_file(tmp_path, shape)],
        env={"SNAKEMAKE_SLURM_GPU_PARTITION": SITE_GPU_PARTITION, "SNAKEMAKE_SLURM_CPU_PARTITION": SITE_CPU_PARTITION},
    )
    plan = parse_dry_run_plan(text)
    by_rule: dict[str, list[PlannedJob]] = {}
    for job in plan:
        by_rule.setdefault(job.rule, []).append(job)
    assert not {"build_tiny_target", "build_smollm2_target"} & set(by_rule), "target.path set: nothing is built"

    extraction = preset["extraction"]
    replicas = by_rule["extract_hidden_states"]
    assert sorted(j.wildcards for j in replicas) == sorted(f"replica={i}" for i in range(extraction["replicas"]))

    def assert_gpu_job(job: PlannedJob, gpus: int, runtime: int) -> None:
        assert job.resources.get("gpu") == str(gpus), job
        assert job.resources.get("slurm_partition") == SITE_GPU_PARTITION, job
        assert job.resources.get("nodes") == "1", job  # --gpus=N is per job: never spread one over nodes
        assert job.resources.get("mem_mb") == str(preset["slurm"]["mem_mb_gpu_job"]), job
        assert job.resources.get("runtime") == str(runtime), job  # attempt 1

    for job in replicas:
        assert_gpu_job(job, extraction["gpus_per_replica"], extraction["runtime_minutes"])
    [canary] = by_rule["canary"]
    assert canary.resources.get("gpu") == str(extraction["gpus_per_replica"])
    [train] = by_rule["train_draft"]
    assert_gpu_job(train, preset["train"]["gpus"], preset["train"]["runtime_minutes"])
    [evaluate] = by_rule["evaluate_draft"]
    assert evaluate.resources.get("gpu") == str(preset["evaluate"]["gpus"])
    for rule in CPU_RULES:
        for job in by_rule[rule]:
            assert job.resources.get("slurm_partition") == SITE_CPU_PARTITION, job
            assert job.resources.get("gpu") in (None, "0"), job


def test_run_config_partitions_win_over_site_settings(tmp_path):
    shape = PRESETS["llama-3.1-8b"]
    paths = user_paths_file(tmp_path, shape, extra={"slurm": {"gpu_partition": "run-gpu", "gpu_model": "h200"}})
    text = dry_run(
        tmp_path, [preset_path("llama-3.1-8b"), paths], env={"SNAKEMAKE_SLURM_GPU_PARTITION": SITE_GPU_PARTITION}
    )
    for job in parse_dry_run_plan(text):
        if job.rule in ("extract_hidden_states", "canary", "train_draft", "evaluate_draft"):
            assert job.resources.get("slurm_partition") == "run-gpu", job
            assert job.resources.get("gpu_model") == "h200", job


def test_run_config_cpu_partition_reaches_every_cluster_rule(tmp_path):
    shape = PRESETS["llama-3.1-8b"]
    paths = user_paths_file(tmp_path, shape, extra={"slurm": {"cpu_partition": "run-cpu"}})
    text = dry_run(tmp_path, [preset_path("llama-3.1-8b"), paths], env={})
    plan = {job.rule: job for job in parse_dry_run_plan(text)}
    for rule in CPU_RULES:
        assert plan[rule].resources.get("slurm_partition") == "run-cpu", plan[rule]


def test_smollm2_gpu_preset_plans_every_stage_on_cpu(tmp_path):
    """Schema validation and DAG planning need no GPU: the whole plan, the target built from the PyPI GGUF."""
    proc = run_workflow(tmp_path / "work", load_preset(GPU_SMOLLM2), extra=["-n"], timeout=300)
    planned = {job.rule for job in parse_dry_run_plan(proc.stdout)}
    stages = {"build_smollm2_target", "regenerate_responses", "prepare_data", "check_api", "canary",
              "extract_hidden_states", "validate_hidden_states", "train_draft", "evaluate_draft", "package_draft",
              "summarize_run", "report"}  # fmt: skip
    assert stages <= planned, stages - planned


def test_cpu_trainer_ranks_size_the_train_draft_job(tmp_path):
    """train.gpus 0 with train.cpu_processes 2: a CPU job with threads for both ranks and their data loaders."""
    shape = PRESETS["llama-3.1-8b"]
    paths = user_paths_file(tmp_path, shape, extra={"train": {"gpus": 0, "cpu_processes": 2, "num_workers": 1}})
    # a local plan (the SLURM profile's dry run prints no threads); --cores 16 leaves the rule's threads uncapped
    proc = run_workflow(tmp_path / "work", [preset_path("llama-3.1-8b"), paths], extra=["-n"], cores=16, timeout=300)
    [train] = [job for job in parse_dry_run_plan(proc.stdout + proc.stderr) if job.rule == "train_draft"]
    assert train.threads == 2 * (1 + 1), train
    assert train.resources.get("gpu") in (None, "0"), train


def test_the_reference_on_the_gpu_gives_validation_a_gpu_job(tmp_path):
    """reference.device: cuda runs validate_hidden_states' full-depth reference on a GPU: its job asks the site's GPU
    partition for one, where with the default (cpu) it is a CPU job."""
    shape = PRESETS["llama-3.1-8b"]
    env = {"SNAKEMAKE_SLURM_GPU_PARTITION": SITE_GPU_PARTITION, "SNAKEMAKE_SLURM_CPU_PARTITION": SITE_CPU_PARTITION}
    jobs = {}
    for device in ("cpu", "cuda"):
        (tmp_path / device).mkdir()
        paths = user_paths_file(tmp_path / device, shape, extra={"reference": {"device": device}})
        plan = parse_dry_run_plan(dry_run(tmp_path / device, [preset_path("llama-3.1-8b"), paths], env=env))
        [jobs[device]] = [job for job in plan if job.rule == "validate_hidden_states"]
    assert jobs["cpu"].resources.get("gpu") in (None, "0"), jobs["cpu"]
    assert jobs["cpu"].resources.get("slurm_partition") == SITE_CPU_PARTITION, jobs["cpu"]
    assert jobs["cuda"].resources.get("gpu") == "1", jobs["cuda"]
    assert jobs["cuda"].resources.get("slurm_partition") == SITE_GPU_PARTITION, jobs["cuda"]
