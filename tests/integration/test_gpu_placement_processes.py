"""GPU placement on a fake GPU machine: real processes, real flock, fake device ids (machine_gpus override).
The in-process parts (the plan, release, lock names): tests/unit/test_gpu_placement.py.

A worker process takes its devices with hold_gpus, starts a child with runtime.child_environment (as the stages
start vLLM and torchrun), writes what the child saw, then waits until the test says every worker has reported
(a state, not a sleep): so all leases overlap in time, and distinct ids prove placement, not luck.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, SEED_PROMPTS, run_workflow, tiny_config, without_gpu_allocation

from eagle3_workflow.runtime.gpu_placement import PlacementSettings, hold_gpus
from eagle3_workflow.settings.errors import StageError

SCRIPTS = REPO / "workflow" / "scripts"
LOG = logging.getLogger("test_gpu_placement")

WORKER = textwrap.dedent(
    """
    import json, logging, os, subprocess, sys, time
    from pathlib import Path
    from eagle3_workflow.runtime.gpu_placement import PlacementSettings, hold_gpus
    from eagle3_workflow.runtime import child_environment

    name, gpus, machine, lock_dir, report_dir, release_file = sys.argv[1:7]
    settings = PlacementSettings(gpus=int(gpus), lock_dir=Path(lock_dir), machine_gpus=int(machine), wait_timeout_s=60, device="auto")
    logging.basicConfig(level=logging.INFO)
    with hold_gpus(settings, logging.getLogger(name), job=name) as devices:
        seen = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', ''))"],
            env=child_environment(), capture_output=True, text=True, check=True,
        ).stdout.strip()
        report = {"name": name, "held": devices, "child_saw": seen}
        tmp = Path(report_dir) / f".{name}.tmp"
        tmp.write_text(json.dumps(report))
        tmp.rename(Path(report_dir) / f"{name}.json")
        deadline = time.monotonic() + 120
        while not Path(release_file).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    """
)


def placement_env() -> dict[str, str | None]:
    """A job on the fake GPU machine: none of the test's own SLURM_* or CUDA_VISIBLE_DEVICES (None unsets them in
    conftest's runner), the workflow's scripts importable."""
    return {**without_gpu_allocation(), "PYTHONPATH": str(SCRIPTS)}


def worker_env() -> dict[str, str]:
    return {name: value for name, value in {**os.environ, **placement_env()}.items() if value is not None}


def start_workers(tmp_path: Path, count: int, gpus: int, machine: int) -> tuple[list[subprocess.Popen], Path, Path]:
    reports, release = tmp_path / "reports", tmp_path / "release"
    reports.mkdir(exist_ok=True)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                f"job{i}",
                str(gpus),
                str(machine),
                str(tmp_path / "locks"),
                str(reports),
                str(release),
            ],
            env=worker_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    return procs, reports, release


def wait_for_reports(procs: list[subprocess.Popen], reports: Path, count: int, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(list(reports.glob("*.json"))) < count:
        dead = [p for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"a worker failed: {dead[0].stderr.read()}"
        assert time.monotonic() < deadline, f"only {len(list(reports.glob('*.json')))} of {count} workers got GPUs"
        time.sleep(0.05)
    return [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]


def finish(procs: list[subprocess.Popen], release: Path) -> None:
    release.touch()
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()


def held_together(tmp_path: Path, count: int, gpus: int) -> list[dict]:
    """`count` workers of `gpus` GPUs each on an 8-GPU machine, all holding their devices at once (each waits for the
    release, which comes once every one has reported): what each held and what its child saw."""
    procs, reports, release = start_workers(tmp_path, count=count, gpus=gpus, machine=8)
    try:
        return wait_for_reports(procs, reports, count)
    finally:
        finish(procs, release)


def test_eight_single_gpu_jobs_get_eight_different_devices(tmp_path):
    seen = held_together(tmp_path, count=8, gpus=1)
    assert sorted(r["child_saw"] for r in seen) == [str(i) for i in range(8)]
    assert all(r["held"] == [r["child_saw"]] for r in seen)


def test_two_four_gpu_jobs_get_disjoint_sets(tmp_path):
    seen = held_together(tmp_path, count=2, gpus=4)
    sets = [set(r["child_saw"].split(",")) for r in seen]
    assert all(len(s) == 4 for s in sets)
    assert sets[0].isdisjoint(sets[1])
    assert sets[0] | sets[1] == {str(i) for i in range(8)}


def test_a_killed_jobs_gpus_are_free_again(tmp_path):
    procs, reports, release = start_workers(tmp_path, count=1, gpus=8, machine=8)
    wait_for_reports(procs, reports, 1)
    busy = PlacementSettings(gpus=1, lock_dir=tmp_path / "locks", machine_gpus=8, wait_timeout_s=0, device="auto")
    with pytest.raises(StageError, match=r"--resources gpu=8"):
        with hold_gpus(busy, LOG, env={}):
            pass
    procs[0].send_signal(signal.SIGKILL)
    assert procs[0].wait(timeout=60) == -signal.SIGKILL
    env: dict[str, str] = {}
    with hold_gpus(
        PlacementSettings(gpus=8, lock_dir=tmp_path / "locks", machine_gpus=8, wait_timeout_s=0, device="auto"),
        LOG,
        env=env,
    ) as devices:
        assert devices == [str(i) for i in range(8)]
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert "CUDA_VISIBLE_DEVICES" not in env  # restored, and the locks released:
    with hold_gpus(
        PlacementSettings(gpus=8, lock_dir=tmp_path / "locks", machine_gpus=8, wait_timeout_s=0, device="auto"),
        LOG,
        env={},
    ):
        pass


# ------------------------------------------------------------------- a local Snakemake run, 8 replica jobs

SNAKEFILE = textwrap.dedent(
    """
    include: "{common}"

    rule all:
        input: expand("done/replica_{{replica}}.txt", replica=REPLICAS)

    rule replica:
        output: "done/replica_{{replica}}.txt"
        log: "logs/replica_{{replica}}.log"
        threads: 1
        resources: **gpu_resources(config["extraction"]["gpus_per_replica"])
        params: release="release", replicas=config["extraction"]["replicas"]
        script: "{script}"
    """
)

REPLICA_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.runtime.gpu_placement import holding_gpus
    from eagle3_workflow.runtime import child_environment

    @holding_gpus(snakemake)
    def body(log):
        seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                              env=child_environment(), capture_output=True, text=True, check=True).stdout.strip()
        log.info("replica %s: child process saw CUDA_VISIBLE_DEVICES=%s", snakemake.wildcards.replica, seen)
        Path("started").mkdir(exist_ok=True)
        Path(f"started/{snakemake.wildcards.replica}").write_text(seen)
        # hold the lease until every replica holds one: they overlap, as 8 vLLM servers would
        deadline = time.monotonic() + 120
        while len(list(Path("started").iterdir())) < snakemake.params.replicas and time.monotonic() < deadline:
            time.sleep(0.05)
        Path(snakemake.output[0]).write_text(seen)

    run_stage("replica", snakemake.log[0], body)
    """
)


def test_local_snakemake_run_places_eight_replicas_on_eight_devices(tmp_path):
    """The real common.smk (config validation, gpu_resources) and the real stage decorator, in real Snakemake
    jobs started by `--cores 8 --resources gpu=8`; only the stage body is a stand-in for the vLLM server."""
    (tmp_path / "replica.py").write_text(REPLICA_SCRIPT)
    snakefile = tmp_path / "Snakefile"
    snakefile.write_text(
        SNAKEFILE.format(common=REPO / "workflow" / "rules" / "common.smk", script=tmp_path / "replica.py")
    )
    config = {
        "run": "placement",
        "target": {"build": {"kind": "tiny"}},
        "data": {},
        "vllm": {"device": "cpu"},
        "extraction": {"replicas": 8, "gpus_per_replica": 1},
        "gpu_placement": {"machine_gpus": 8, "lock_dir": str(tmp_path / "locks")},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    run_workflow(
        tmp_path,
        [tmp_path / "config.json"],
        snakefile=snakefile,
        cores=8,
        extra=["--resources", "gpu=8"],
        env=placement_env(),
        timeout=300,
    )
    held = {}
    for replica in range(8):
        log_text = (tmp_path / "logs" / f"replica_{replica}.log").read_text()
        lines = [line for line in log_text.splitlines() if "gpu placement: holding GPU(s)" in line]
        assert len(lines) == 1, log_text
        held[replica] = lines[0].split("holding GPU(s) ")[1].split(" ")[0]
        assert f"child process saw CUDA_VISIBLE_DEVICES={held[replica]}" in log_text
    assert sorted(held.values()) == [str(i) for i in range(8)], held


# ------------------------------------------------------------------- the real rules

GPU_RULES = {"regenerate_responses": 1, "canary": 1, "extract_hidden_states": 1, "train_draft": 2, "evaluate_draft": 1}


def planned_resources(stdout: str) -> dict[str, list[str]]:
    """rule -> the `resources:` lines of its jobs in a dry run's plan."""
    found: dict[str, list[str]] = {}
    rule = None
    for line in stdout.splitlines():
        if line.startswith(("rule ", "localrule ")):
            rule = line.split()[1].rstrip(":")
        elif line.strip().startswith("resources:") and rule:
            found.setdefault(rule, []).append(line.strip())
    return found


def test_every_gpu_rule_declares_its_placement(tmp_path):
    """The real workflow's plan: every GPU-using rule carries gpu=N and the placement settings, CPU rules
    neither; and every GPU stage's entry point holds its devices."""
    import eagle3_workflow.canary.stage as canary
    import eagle3_workflow.evaluation.stage as evaluation
    import eagle3_workflow.extraction.stage as extraction
    import eagle3_workflow.regenerate.stage as regenerate
    import eagle3_workflow.training.stage as training

    config = tiny_config(
        "plan",
        regenerate={"enabled": True, "prompt_files": [str(SEED_PROMPTS)]},
        extraction={"replicas": 8, "gpus_per_replica": 1},
        train={"gpus": 2},
        evaluate={"gpus": 1},
        gpu_placement={"machine_gpus": 8},
    )
    proc = run_workflow(tmp_path, config, extra=["-n"], env=placement_env())
    plan = planned_resources(proc.stdout)
    assert set(GPU_RULES) <= set(plan), sorted(plan)
    assert len(plan["extract_hidden_states"]) == 8
    for rule, lines in plan.items():
        for line in lines:
            if rule in GPU_RULES:
                assert f"gpu={GPU_RULES[rule]}," in line, (rule, line)
                assert '"machine_gpus": 8' in line, (rule, line)
            else:
                assert "gpu_placement" not in line, (rule, line)
    for stage in (canary, evaluation, extraction, regenerate, training):
        assert "@holding_gpus(snakemake)" in inspect.getsource(stage.main), stage.__name__


# The real canary and extraction rules holding their devices (vLLM on CPU, a fake 2-GPU machine):
# tests/integration/test_extraction_server.py runs every extraction of its module that way, and its
# test_the_real_gpu_stages_hold_their_devices reads the holds back from the logs.
