"""A rule reruns exactly when a config value its stage reads changes (docs/reruns.md).

Stages read config only from their rule's params: `stage_params("<rule>")` in workflow/rules/common.smk, the keys
the stage's settings model declares (eagle3_workflow.settings). READS below says, independently of those models,
which keys each rule's stage is meant to read: whole sections where a stage uses a section whole, less the keys
in NOT_READ that only size a job or decide which jobs exist. It is written by hand on purpose: an expectation
derived from the models would agree with any model, so a model that reads too much (a rerun for nothing) or too
little (a stale result) would pass. Coarse on purpose too: a new key in a section a rule reads whole (a new
evaluate.* key) is expected to rerun that rule without an edit here, and the test fails until the stage's model
declares it, or until the key is named in NOT_READ as a resource.

The table is checked against the params the rules declare (loaded through Snakemake's API). Then, on a run whose
every output is staged as complete (placeholders, recorded with Snakemake's touch executor), every config key is
changed in turn and a dry run plans, for the reason "params changed", exactly the rules that read it: each key a
stage reads replans it, every other key leaves it alone. The dry runs use only the params trigger
(`--rerun-triggers params`): the staged placeholders are empty files, which the code and input triggers would
otherwise also flag.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO

pytest.importorskip("snakemake.api")
from snakemake.api import SnakemakeApi  # noqa: E402
from snakemake.settings.enums import Quietness, RerunTrigger  # noqa: E402
from snakemake.settings.types import (  # noqa: E402
    ConfigSettings,
    DAGSettings,
    OutputSettings,
    ResourceSettings,
    StorageSettings,
)

EVERY_KEY = "*"
# how a stage that serves the target with vLLM loads it: its dtype and trust, the vllm section, the TP of its server
SERVES_TARGET = {"target/dtype", "target/trust_remote_code", "vllm", "extraction/tensor_parallel_size"}
# rule -> the config keys ("section" or "section/key") its stage reads; EVERY_KEY: it records the whole config
READS: dict[str, set[str]] = {
    "record_provenance": {EVERY_KEY},
    "report": {EVERY_KEY},
    "build_tiny_target": {"target/build"},
    "build_kimi_k25_target": {"target/build"},
    "build_smollm2_target": {"target/dtype"},
    "prepare_data": {"data", "target/trust_remote_code"},
    "check_target": {"target_check", *SERVES_TARGET},
    # the whole section: its stats file records it
    "regenerate_responses": {"regenerate", *SERVES_TARGET},
    "check_api": {
        "check_api",
        "hidden_states/layer_ids",
        "target/trust_remote_code",
        "validation/full_depth_check",
        # the canary reference row: the proof the canary will run (self_consistency builds no reference)
        "canary/reference",
        "vllm/device",
    },
    # the extraction client's stall limits: the canary goes through the production client
    # reference/device: where the fp32 reference runs (canary, full depth, draft parity)
    "canary": {"canary", "extraction/stall_timeout_s", "extraction/stall_factor", "reference", *SERVES_TARGET},
    "extract_hidden_states": {"extraction", *SERVES_TARGET},
    "validate_hidden_states": {"validation", "target/trust_remote_code", "reference"},
    # the whole section: train.gpus picks torchrun or the CPU shim, the work dir's fingerprint records the rest
    "train_draft": {"train", "target/trust_remote_code"},
    # train_data_ratio: the held-out prompts are the rows the trainer did not train on
    "evaluate_draft": {
        "evaluate",
        "vllm",
        "train/train_data_ratio",
        "target/dtype",
        "target/trust_remote_code",
        "reference",
    },
    # the sections the model card quotes from
    "package_draft": {"run", "target", "regenerate", "train", "evaluate", "vllm"},
    "summarize_run": set(),
    "all": set(),
}
# rule -> keys inside what READS names that its stage does not read: they size the job (its resources) or decide
# whether the job exists and what its inputs are
NOT_READ: dict[str, set[str]] = {
    # kind picks the build rule; quantization, the widths and the weights' kind are the Kimi stand-in's, arch the
    # tiny target's
    "build_tiny_target": {"target/build/kind", "target/build/quantization"}
    | {
        f"target/build/{key}"
        for key in (
            "num_heads",
            "q_lora_rank",
            "intermediate_size",
            "moe_intermediate_size",
            "routed_experts",
            "experts_per_token",
            "padded_vocab_size",
            "weights",
        )
    },
    "build_kimi_k25_target": {"target/build/kind", "target/build/arch"},
    "prepare_data": {"data/sources"},  # the rule's inputs (and params.formats)
    "check_target": {"target_check/enabled"},  # whether the rule runs
    "extract_hidden_states": {"extraction/gpus_per_replica", "extraction/runtime_minutes"},  # resources
    "evaluate_draft": {"evaluate/gpus"},  # a resource
    # the presets train offline: train.online sizes the online trainer's server and is read only online
    "train_draft": {"train/online"},
}
# Keys that change which jobs or files exist (a new run name, another target, other inputs): what they replan is
# decided by missing outputs and inputs, not params, so they are left out of the per-key dry runs.
SHAPE_KEYS = {
    "run",
    "target/path",
    "target/build/kind",
    "data/sources",
    "regenerate/enabled",
    "regenerate/prompt_files",
    "target_check/enabled",
    # offline <-> online: extraction and validation cover every row or the check set, training gets a server
    "train/hidden_states",
}
# a changed value the schema accepts and the dry run can plan with (evaluate.prompts=file needs a prompt file)
CHANGED = {
    "evaluate/prompts": lambda value: "heldout" if value == "humaneval" else "humaneval",
    "regenerate/magpie_steered": lambda value: [*value, {"name": "changed", "prompts": 2, "system_prompt": "Changed."}],
}
PRESETS = ["tiny", "smollm2-135m"]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())


def leaves(value: Any, prefix: str) -> set[str]:
    """The "section/key/..." paths of the values under `value` (lists and empty sections count as values)."""
    if isinstance(value, dict) and value:
        return set().union(*(leaves(v, f"{prefix}/{k}" if prefix else k) for k, v in value.items()))
    return {prefix}


def at(config: dict, dpath: str) -> Any:
    for key in dpath.split("/"):
        config = config[key]
    return config


def read_leaves(rule: str, config: dict) -> set[str]:
    """READS of a rule as config leaves, less its NOT_READ."""
    if EVERY_KEY in READS[rule]:
        return leaves(config, "")
    read = set().union(set(), *(leaves(at(config, d), d) for d in READS[rule]))
    return read - set().union(set(), *(leaves(at(config, d), d) for d in NOT_READ.get(rule, set())))


def declared_leaves(params: Any) -> set[str]:
    """The config leaves a rule's params carry (every rule's config reaches it as `settings`, or as the whole
    resolved config in `config`)."""
    if "config" in params.keys():
        return leaves(json.loads(params.config), "")
    if "settings" in params.keys():
        return leaves(params.settings, "")
    return set()


def schema_of(dpath: str) -> dict:
    node = SCHEMA
    for key in dpath.split("/"):
        node = node["properties"][key]
    return node


def changed_value(dpath: str, value: Any) -> Any:
    """Another value the schema accepts."""
    if dpath in CHANGED:
        return CHANGED[dpath](value)
    node = schema_of(dpath)
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if "enum" in node:
        return next(v for v in node["enum"] if v != value)
    if isinstance(value, bool) or (value is None and "boolean" in types):
        return not value
    if isinstance(value, int) or (value is None and "integer" in types):
        return (value or node.get("minimum", 1)) + 1
    if isinstance(value, float):
        return value / 2 if "maximum" in node else value + 0.5
    if value is None and "number" in types:
        return node.get("maximum", 1) / 2
    if isinstance(value, list) or (value is None and "array" in types):
        return (value or []) + ([2, 3] if node.get("items", {}).get("type") == "integer" else ["--changed"])
    return (value or "") + "changed"


def nested(dpath: str, value: Any) -> dict:
    for key in reversed(dpath.split("/")):
        value = {key: value}
    return value


def preset_path(preset: str) -> Path:
    return REPO / "config" / "presets" / f"{preset}.yaml"


@dataclasses.dataclass(frozen=True)
class Plan:
    planned: set[str]  # the rules a dry run plans
    params_changed: set[str]  # the rules whose params differ from those recorded (the planner's params trigger)
    downstream: dict[str, set[str]]  # rule -> the rules that take its outputs, directly or not


class Workflow:
    """The real workflow of one preset in one working directory, through Snakemake's API."""

    def __init__(self, preset: str, workdir: Path):
        self.preset = preset
        self.workdir = workdir

    def run(self, executor: str, overrides: dict | None = None) -> tuple[Any, Plan]:
        """Plan the run ("dryrun"), or record every job as done ("touch": outputs touched in the DAG's order,
        params stored); returns the loaded workflow and the plan."""
        with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
            workflow_api = api.workflow(
                resource_settings=ResourceSettings(cores=1),
                config_settings=ConfigSettings(configfiles=[preset_path(self.preset)], config=overrides or {}),
                storage_settings=StorageSettings(),
                snakefile=REPO / "Snakefile",
                workdir=self.workdir,
            )
            dag_api = workflow_api.dag(
                DAGSettings(rerun_triggers=frozenset({RerunTrigger.PARAMS}), forceall=executor == "touch")
            )
            dag_api.execute_workflow(executor=executor)
            workflow = workflow_api._workflow
            return workflow, plan_of(workflow)

    def plan(self, overrides: dict) -> Plan:
        return self.run("dryrun", overrides)[1]


def plan_of(workflow: Any) -> Plan:
    """What the dry run planned. A job planned because an upstream job reruns has its own params check skipped
    by the planner (one reason is enough), so the params trigger is also asked of every job directly."""
    dag = workflow.dag
    jobs = list(dag.jobs)
    changed = {job.rule.name for job in jobs if workflow.persistence.params_changed(job)}
    downstream: dict[str, set[str]] = {}
    for job in jobs:
        seen, todo = set(), list(dag.depending[job])
        while todo:
            later = todo.pop()
            if later not in seen:
                seen.add(later)
                todo.extend(dag.depending[later])
        downstream.setdefault(job.rule.name, set()).update(j.rule.name for j in seen)
    planned = {job.rule.name for job in dag.needrun_jobs(exclude_finished=False)}
    return Plan(planned=planned, params_changed=changed, downstream=downstream)


@pytest.fixture(scope="module", params=PRESETS)
def staged(request, tmp_path_factory):
    """A workdir where every output of the preset's run exists and Snakemake has recorded its params."""
    flow = Workflow(request.param, tmp_path_factory.mktemp(request.param))
    workflow, _ = flow.run("dryrun")
    for job in workflow.dag.needrun_jobs(exclude_finished=False):
        for output in job.output:
            path = flow.workdir / str(output)
            if output.is_directory:
                path.mkdir(parents=True, exist_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    workflow, _ = flow.run("touch")
    unchanged = flow.plan({})
    assert unchanged.planned == set(), "a staged run with an unchanged config must plan nothing"
    return flow, workflow, unchanged.downstream


def test_reads_table_matches_the_params_each_rule_declares(staged):
    _, workflow, _ = staged
    config = workflow.config
    rules = {rule.name: rule for rule in workflow.rules}
    assert set(rules) <= set(READS), f"rules missing from READS: {sorted(set(rules) - set(READS))}"
    drift = {
        name: {"declared": sorted(declared_leaves(rule.params)), "table": sorted(read_leaves(name, config))}
        for name, rule in rules.items()
        if declared_leaves(rule.params) != read_leaves(name, config)
    }
    assert drift == {}


@pytest.mark.slow  # ~40-80 s of dry runs over every key: `make test` runs it, the edit loop (`make test-fast`) does not
def test_each_key_replans_exactly_the_rules_that_read_it(staged):
    flow, workflow, downstream = staged
    config = copy.deepcopy(workflow.config)
    rules = [rule.name for rule in workflow.rules]
    readers = {name: read_leaves(name, config) for name in rules}
    wrong = {}
    for dpath in sorted(leaves(config, "") - SHAPE_KEYS):
        reading = {name for name in rules if dpath in readers[name]}
        # the readers rerun for their params; the rules after them, because their inputs will change
        after = set().union(set(), *(downstream.get(name, set()) for name in reading))
        plan = flow.plan(nested(dpath, changed_value(dpath, at(config, dpath))))
        if plan.params_changed != reading or plan.planned != reading | after:
            wrong[dpath] = {
                "read by": sorted(reading),
                "params changed": sorted(plan.params_changed),
                "planned, not after a reader": sorted(plan.planned - after),
            }
    assert wrong == {}
    # every rule that reads config was replanned by at least one key of this preset
    assert all(readers[name] - SHAPE_KEYS for name in rules if READS[name])
