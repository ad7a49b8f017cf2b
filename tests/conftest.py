"""Shared fixtures: repository paths, tiny targets built once per session, the one workflow runner, and the
folder markers (tests/unit, tests/integration, tests/e2e: README.md, "Tests").

Tests run the real thing: real tokenizers, real vLLM (CPU build), the real speculators trainer. A tiny target
per architecture is built once per session (a few seconds each).
"""

from __future__ import annotations

import copy
import errno
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import yaml

# The suite runs TEST_WORKERS (3) pytest processes on 2 cores, each starting vLLM servers, trainers and Snakemake
# stages: the cores are oversubscribed by design. OpenMP threads that spin at barriers (GNU OpenMP's default) then
# burn the time of everything beside them: the tiny pipeline's train_draft took 102 s in a clean-clone run against
# 19 s alone, and 111 s against 28 s beside two busy processes with passive waiting (2026-12-04). Every process
# of the suite (torch in the test processes, the stages, their trainers and engines) inherits this before any of
# them loads OpenMP; the workflow itself sets it for the processes it starts on CPU (runtime.child_environment,
# training.launcher.trainer_env). A value in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from eagle3_workflow.settings.sections import (
    DataPreparation,
    EvaluationSettings,
    OnlineTrainSettings,
    RegenerateSettings,
    TinyShape,
    TrainSettings,
)
from eagle3_workflow.settings.views import view_of, with_schema_defaults

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
VENV_BIN = Path(sys.executable).parent
SNAKEMAKE = str(VENV_BIN / "snakemake")
SNAKEFILE = REPO / "Snakefile"
TINY_PRESET = REPO / "config" / "presets" / "tiny.yaml"
TINY_DATA = REPO / "config" / "data" / "tiny_conversations.jsonl"
SEED_PROMPTS = REPO / "config" / "data" / "seed_prompts.txt"
VLLM_LOGS = TESTS / "vllm_logs"  # failure logs in vLLM's output shapes (tests/vllm_logs/README.md)
# Snakemake command lines the tests ran in this process (dry runs among them), the jobs they ran and their wall
# seconds: the timeline's snakemake_* fields
_SNAKEMAKE_RUNS = {"runs": 0, "dry_runs": 0, "jobs": 0, "seconds": 0.0}
DRY_RUN_FLAGS = {"-n", "--dry-run", "--dryrun"}


def load_script(path: Path) -> ModuleType:
    """A script that is not a package module (bench/, envs/), imported from its file under its own name."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(run: str = "t", **overrides: dict) -> dict:
    """The tiny preset with absolute data paths (tests run in temporary working directories)."""
    config = yaml.safe_load(TINY_PRESET.read_text())
    config["run"] = run
    config["data"]["sources"] = [{"path": str(TINY_DATA), "format": "sharegpt"}]
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


# regenerate.* of the tiny runs (regenerate() takes max_model_len beside them)
REGENERATE_SETTINGS = {
    "magpie_prompts": 0,
    "magpie_max_tokens": 16,
    "magpie_min_chars": 5,
    "magpie_temperature": 1.0,
    "max_prompts": None,
    "max_tokens": 8,
    "temperature": 0.0,
    "seed": 0,
}


# Site settings of whoever runs the tests must not shape a plan: every SNAKEMAKE_SLURM_* that profiles/slurm reads
# is pinned (empty = unset) and its override file is empty.
NO_SITE_SETTINGS = {
    **{
        f"SNAKEMAKE_SLURM_{name}": ""
        for name in ("ACCOUNT", "NO_ACCOUNT", "CPU_PARTITION", "GPU_PARTITION", "GPU_MODEL", "QOS", "STATUS_COMMAND")
    },
    "SNAKEMAKE_SLURM_OVERRIDES": os.devnull,
}


def workflow_command(
    workdir: Path,
    config: dict | list[Path],
    targets: list[str] | None = None,
    *,
    extra: list[str] | None = None,
    snakefile: Path | None = SNAKEFILE,
    cores: int | None = 2,
) -> list[str]:
    """The `snakemake` command line that runs a workflow in `workdir`. `config` is a dict (written to
    workdir/config-<run>.yaml) or config files as a user passes them (later files win). snakefile=None: the one
    Snakemake finds in `workdir` (a deployed module); cores=None: no --cores (a profile's or a dry run's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if isinstance(config, dict):
        config_path = workdir / f"config-{config['run']}.yaml"
        config_path.write_text(yaml.safe_dump(copy.deepcopy(config)))
        config = [config_path]
    return [
        SNAKEMAKE,
        *(["-s", str(snakefile)] if snakefile is not None else []),
        "-d",
        str(workdir),
        *(["--cores", str(cores)] if cores is not None else []),
        *(targets or []),
        *(extra or []),
        "--configfile",  # last: it takes every following word as a config file
        *map(str, config),
    ]


def without_gpu_allocation() -> dict[str, None]:
    """For workflow_env: unset the SLURM_* and CUDA_VISIBLE_DEVICES of the shell running the tests, so that a run
    on a fake GPU machine (gpu_placement.machine_gpus) takes its devices from that machine, not an allocation."""
    return {name: None for name in os.environ if name.startswith("SLURM_") or name == "CUDA_VISIBLE_DEVICES"}


def workflow_env(env: dict | None = None) -> dict[str, str]:
    """The test's environment plus `env` (a None value unsets the variable), with this venv's bin first on PATH
    (jobs run `python`, `snakemake`)."""
    full_env = {name: value for name, value in {**os.environ, **(env or {})}.items() if value is not None}
    full_env["PATH"] = f"{VENV_BIN}{os.pathsep}{full_env.get('PATH', '')}"
    return full_env


def validated(config: dict) -> dict:
    """A copy of `config` as the rules see it: checked by the schema, every default filled."""
    from eagle3_workflow.settings.schema import validate_config
    from eagle3_workflow.settings.views import SCHEMA_PATH

    config = copy.deepcopy(config)
    validate_config(config, SCHEMA_PATH)
    return config


def preparation(**values) -> DataPreparation:
    """The data settings prepare_data reads, setting `values`: the schema's defaults elsewhere."""
    return view_of(DataPreparation, with_schema_defaults(data=values)["data"])


def tiny_settings(model, **overrides: dict):
    """`model` of the tiny preset (tiny_config(**overrides)) as the rules validate it."""
    return view_of(model, validated(tiny_config(**overrides)))


def regenerate_settings(**overrides) -> RegenerateSettings:
    """REGENERATE_SETTINGS with `overrides`, the schema's defaults for the rest of the section."""
    return RegenerateSettings.model_validate(
        with_schema_defaults(regenerate={**REGENERATE_SETTINGS, **overrides})["regenerate"]
    )


def evaluation(**values) -> EvaluationSettings:
    """The evaluate settings setting `values`, the schema's defaults elsewhere."""
    return view_of(EvaluationSettings, with_schema_defaults(evaluate=values)["evaluate"])


def train_settings(values: dict) -> TrainSettings:
    """The train section setting `values`, the schema's defaults elsewhere: as offline training reads it, or
    online training (train.online too) where values say hidden_states: online."""
    section = with_schema_defaults(train=values)["train"]
    model = OnlineTrainSettings if section["hidden_states"] == "online" else TrainSettings
    return view_of(model, section)


def run_workflow(
    workdir: Path,
    config: dict | list[Path],
    targets: list[str] | None = None,
    *,
    extra: list[str] | None = None,
    check: bool = True,
    timeout: float = 1500,
    env: dict | None = None,
    snakefile: Path | None = SNAKEFILE,
    cores: int | None = 2,
) -> subprocess.CompletedProcess:
    """Run the real workflow in `workdir` (see workflow_command); returns the completed process (output captured).
    check: a non-zero exit fails the test with the ends of stdout and stderr."""
    cmd = workflow_command(workdir, config, targets, extra=extra, snakefile=snakefile, cores=cores)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=timeout, env=workflow_env(env))
    dry = bool(DRY_RUN_FLAGS & set(extra or []))  # its `rule x:` lines are planned jobs
    _SNAKEMAKE_RUNS.update(runs=_SNAKEMAKE_RUNS["runs"] + 1, dry_runs=_SNAKEMAKE_RUNS["dry_runs"] + dry,
                           jobs=_SNAKEMAKE_RUNS["jobs"] + (0 if dry else len(rules_run(proc))),
                           seconds=_SNAKEMAKE_RUNS["seconds"] + time.monotonic() - started)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake failed ({proc.returncode}):\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-12000:]}"
        )
    return proc


def start_workflow(
    workdir: Path,
    config: dict | list[Path],
    log: Path,
    targets: list[str] | None = None,
    *,
    extra: list[str] | None = None,
    env: dict | None = None,
) -> subprocess.Popen:
    """Start the real workflow in `workdir` without waiting for it (the tests that kill it); stdout and stderr go
    to `log`. The caller waits for a state, kills, and reaps the process."""
    cmd = workflow_command(workdir, config, targets, extra=extra)
    _SNAKEMAKE_RUNS["runs"] += 1  # its jobs and time are not counted: the test decides when it ends
    _SNAKEMAKE_RUNS["dry_runs"] += bool(DRY_RUN_FLAGS & set(extra or []))
    with open(log, "w") as output:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, cwd=workdir, stdout=output, stderr=subprocess.STDOUT, env=workflow_env(env))


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Wait for a state (`condition` true), polling; `timeout_s` only guards against a hang, it is no verdict on
    speed: make it generous (this runs on a loaded 2-core machine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process the test started and every process below it (by pid, the tree as seen from the top), as a
    lost login node would: nothing of it gets to clean up. Reaps `proc`."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(tree, timeout=30)


def rules_run(proc: subprocess.CompletedProcess) -> list[str]:
    """The rules a Snakemake invocation ran, in the order it started them (its `rule x:` / `localrule x:` lines)."""
    return re.findall(r"^(?:local)?rule (\w+):", proc.stdout + proc.stderr, flags=re.MULTILINE)


def synthetic_run_config(workdir: Path, target: Path, run: str = "t", **overrides: dict) -> dict:
    """tiny_config for a finished run written by tests/synthetic_run.py in `workdir` on the target folder `target`
    (nothing built), for the last rules to run alone: its data source is the run's own copy of the data."""
    from synthetic_run import synthetic_data

    config = tiny_config(run, target={"path": str(target)}, **overrides)
    config["target"].pop("build")
    config["data"]["sources"] = [{"path": str(synthetic_data(workdir)), "format": "sharegpt"}]
    return config


def api_report(target: Path, **overrides):
    """check_api's report on a target, with the CPU settings the tests use (keyword overrides win)."""
    from eagle3_workflow.api_checks.checks import run_api_checks

    kwargs = dict(
        target_dir=str(target),
        prepared_dir=None,
        configured_layer_ids=None,
        vllm_min="0.18.0",
        vllm_max_exclusive="0.34.0",
        device="cpu",
        trust_remote_code=False,
        full_depth_check=True,
    )
    return run_api_checks(**(kwargs | overrides))


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs of the test's own: a file system a test can fill up without touching the host's disk
    (mounting needs root; without it the test is skipped with the reason)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()!r}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def fill_up(path: Path) -> None:
    """Another job's file: written until the file system says ENOSPC, down to its last page."""
    with open(path, "wb", buffering=0) as filler:
        for chunk in (1 << 20, 4096):
            try:
                while True:
                    filler.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, repr(exc)


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Build tiny targets lazily, once per shape: tiny_targets('llama') -> Path; other target.build keys as keywords
    (tiny_targets('deepseek_v3', hidden_size=128))."""
    from eagle3_workflow.target_build.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("tiny_targets")
    built: dict[str, Path] = {}

    def get(arch: str = "llama", num_layers: int = 8, **shape_keys: int) -> Path:
        key = "-".join([arch, str(num_layers), *(f"{k}{v}" for k, v in sorted(shape_keys.items()))])
        if key not in built:
            build = {"kind": "tiny", "arch": arch, "num_layers": num_layers, **shape_keys}
            shape = view_of(TinyShape, with_schema_defaults(target={"build": build})["target"]["build"])
            built[key] = build_tiny_target(root / key, [TINY_DATA, SEED_PROMPTS], shape)
        return built[key]

    return get


@pytest.fixture(scope="session")
def kimi_stand_ins(tmp_path_factory):
    """The Kimi-K2.5 stand-in (target.build.kind kimi_k25), built lazily once per variant: kimi_stand_ins('none')
    (bf16) or kimi_stand_ins('int4') -> Path."""
    from eagle3_workflow.settings.sections import KimiShape
    from eagle3_workflow.target_build.kimi import build_kimi_k25_target

    root = tmp_path_factory.mktemp("kimi_stand_ins")
    built: dict[str, Path] = {}

    def get(quantization: str = "none", num_layers: int = 8) -> Path:
        key = f"{quantization}-{num_layers}"
        if key not in built:
            build = {"kind": "kimi_k25", "quantization": quantization, "num_layers": num_layers, "hidden_size": 128}
            shape = view_of(KimiShape, with_schema_defaults(target={"build": build})["target"]["build"])
            built[key] = build_kimi_k25_target(root / key, [TINY_DATA, SEED_PROMPTS], shape)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_targets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_targets("llama"))


@pytest.fixture(scope="session")
def prepared(tiny_targets, tmp_path_factory):
    """A real prepared dataset (prepare_data's functions) of 64 rows on the tiny llama target: target,
    prepared/ and token frequencies (the evaluation tests, unit and integration)."""
    from transformers import AutoTokenizer

    from eagle3_workflow.prepare.conversations import prepare_conversations, token_frequencies, write_prepared

    target = tiny_targets("llama")
    out = tmp_path_factory.mktemp("prepared")
    result = prepare_conversations([(TINY_DATA, "sharegpt")], AutoTokenizer.from_pretrained(target),
                                   preparation(max_seq_len=256, max_samples=64))  # fmt: skip
    write_prepared(result, out / "prepared", out / "token_freq.pt")
    return {"target": target, "prepared": out / "prepared", "token_freq": token_frequencies(result.samples)}


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The whole tiny pipeline, run once from an empty working directory as `make demo` runs it: (workdir, config,
    wall seconds). Read-only: a test that reruns part of it works on `copied_run(...)`."""
    workdir = tmp_path_factory.mktemp("tiny_pipeline")
    config = tiny_config(run="tiny")
    started = time.monotonic()
    run_workflow(workdir, config)
    return workdir, config, time.monotonic() - started


def copied_run(workdir: Path, dest: Path, *, without: Path | tuple[Path, ...] = ()) -> Path:
    """A copy of a finished run's working directory (results and .snakemake, file times kept), to rerun parts of it
    without touching the original; `dest` may exist (a test's tmp_path). without: folders of the run (relative to
    the working directory) left out of the copy, e.g. its hidden states, so that the rerun makes them again."""
    shutil.copytree(workdir, dest, symlinks=True, dirs_exist_ok=True)
    for folder in (without,) if isinstance(without, Path) else without:
        shutil.rmtree(dest / folder)
    return dest


# ---------------------------------------------------------------- where a suite's time goes

# EAGLE3_TEST_TIMELINE=<file>: each worker appends one JSON line per test (worker, test, start and stop as epoch
# seconds, and the CPU seconds it used with every child process it waited for: Snakemake, stages, vLLM; the
# Snakemake command lines it ran through run_workflow/start_workflow, dry runs among them, the jobs they ran and
# their wall seconds),
# for bench/suite/timeline.py to show which tests cost most and which end last.
TIMELINE = os.environ.get("EAGLE3_TEST_TIMELINE")
_TEST_STARTED: dict[str, tuple[float, float, dict[str, float]]] = {}
_XDIST_CONTROLLER = [False]  # the process that hands tests to xdist workers runs none itself


def pytest_configure(config: pytest.Config) -> None:
    _XDIST_CONTROLLER[0] = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if TIMELINE and not _XDIST_CONTROLLER[0]:
        _TEST_STARTED[nodeid] = (time.time(), _cpu_seconds(), dict(_SNAKEMAKE_RUNS))


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if not TIMELINE or nodeid not in _TEST_STARTED:
        return
    import json

    started, cpu, snakemake = _TEST_STARTED.pop(nodeid)
    line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": nodeid, "start": started,
            "stop": time.time(), "cpu": round(_cpu_seconds() - cpu, 2),
            **{f"snakemake_{k}": round(v - snakemake[k], 2) for k, v in _SNAKEMAKE_RUNS.items()}}  # fmt: skip
    with open(TIMELINE, "a") as timeline:  # one short write per line: workers do not interleave
        timeline.write(json.dumps(line) + "\n")


# ---------------------------------------------------------------- the folder is the kind of test

FOLDER_MARKERS = ("unit", "integration", "e2e")  # registered, with what each folder holds, in pyproject.toml


# ---------------------------------------------------------------- how `make test` spreads tests over workers
# `make test` runs pytest-xdist with --dist loadgroup: tests that share an expensive fixture built once per module
# (or the session's tiny pipeline) form one group and run on one worker, so it is built once; every other test is
# scheduled on its own, so the long independent ones run side by side. Slow tests are handed out first.

SHARED_SESSION_FIXTURES = ("tiny_pipeline",)


def shared_fixture_group(item: pytest.Item) -> str | None:
    """The xdist group of a test: the module-scoped fixtures (and shared session runs) it uses, or None."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = sorted(
        f"{item.path.stem}.{name}" if defs[-1].scope == "module" else name
        for name, defs in info.name2fixturedefs.items()
        if defs and (defs[-1].scope == "module" or name in SHARED_SESSION_FIXTURES)
    )
    return "+".join(shared) or None


def pytest_itemcollected(item: pytest.Item) -> None:
    """The group marker, set as each test is collected: xdist reads it in its own collection_modifyitems."""
    group = shared_fixture_group(item)
    if group and not item.get_closest_marker("xdist_group"):
        item.add_marker(pytest.mark.xdist_group(group))


def order_for_workers(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)  # stable: file order within each
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers only, with --dist loadgroup
        return
    # pytest-xdist 3.8 names a group by appending "@group" to item._nodeid, which pytest 9 no longer reads (a
    # node's id is its structured _id): every test was scheduled alone and the tiny pipeline ran on each worker.
    # The same suffix, where pytest 9 keeps it.
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest < 9: xdist's own suffix works
        return
    for item in items:
        groups = sorted({str(mark.args[0]) for mark in item.iter_markers("xdist_group") if mark.args})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Each test gets the marker of its folder (tests/unit/... -> unit), so `-m unit` and the folder select the
    same tests. A test file outside these folders and tests/gpu, or a slow-marked test in tests/unit (the edit
    loop), is refused."""
    for item in items:
        if not item.path.is_relative_to(TESTS):  # a path outside tests/ given on the command line
            continue
        parts = item.path.relative_to(TESTS).parts
        folder = parts[0] if len(parts) > 1 else None
        if folder == "gpu":
            continue
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: put the test in tests/{{{','.join(FOLDER_MARKERS)}}}/")
        if folder == "unit" and item.get_closest_marker("slow"):
            raise pytest.UsageError(f"{item.nodeid}: a slow test belongs in tests/integration or tests/e2e")
        item.add_marker(folder)
    order_for_workers(config, items)


def shift_d2t(weights: Path) -> None:
    """Each draft id of a draft's weights names its neighbour's target token (d2t holds target id - draft id): the
    served-draft fault, and another vocabulary mapping as a retrained draft may have."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(weights))
    ids = torch.arange(len(tensors["d2t"]), dtype=tensors["d2t"].dtype)
    tensors["d2t"] = torch.roll(ids + tensors["d2t"], -1) - ids
    save_file(tensors, str(weights), metadata=metadata)
