"""evaluate_draft's measurement processes at once (evaluate.concurrent_processes): when they run at once, each
engine's share of the GPU, which lock mode each pass holds, and (cheaply, on CPU) real measurement processes
against a stand-in vLLM whose engines sleep and log what they do: no timing pass overlaps anything another process
does, waiting for the lock is not a stall, a failing process stops the others, and a rerun reuses every engine."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import evaluation, tiny_settings

from eagle3_workflow.evaluation.gate import LOCK_MODES, Gate
from eagle3_workflow.evaluation.measure import measure_run
from eagle3_workflow.evaluation.measurements import Evaluation, measure_runs
from eagle3_workflow.evaluation.plan import PlannedProcess, concurrent_processes, engine_memory, plan_measurements
from eagle3_workflow.evaluation.prompts import EvalPrompt, PromptSet
from eagle3_workflow.evaluation.protocol import MeasurementRun, MeasurementSpec, eagle3_run
from eagle3_workflow.files.chat import StopSet
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ServingStage

VLLM_SETTINGS = tiny_settings(ServingStage).vllm  # the vllm section of a tiny run (CPU)
GPU_VLLM = VLLM_SETTINGS.model_copy(update={"device": "cuda", "kv_cache_memory_bytes": None,
                                            "gpu_memory_utilization": 0.85})  # fmt: skip
GIB = 1 << 30


# ---------------------------------------------------------------- when the processes run at once


def test_processes_run_at_once_on_cuda_with_a_fixed_kv_cache_and_never_by_default_on_cpu():
    fixed = GPU_VLLM.model_copy(update={"kv_cache_memory_bytes": 16 * GIB})
    assert concurrent_processes(evaluation(), fixed, "cuda")
    assert concurrent_processes(evaluation(kv_cache_memory_bytes=4 * GIB), GPU_VLLM, "cuda")
    # vLLM sizes a KV cache by profiling, which fails when a sibling frees memory meanwhile
    assert not concurrent_processes(evaluation(), GPU_VLLM, "cuda")
    assert not concurrent_processes(evaluation(tensor_parallel_size=2), fixed, "cuda")
    assert not concurrent_processes(evaluation(), VLLM_SETTINGS, "cpu")  # the tiny preset has a fixed KV cache
    assert not concurrent_processes(evaluation(concurrent_processes=False), fixed, "cuda")
    assert concurrent_processes(evaluation(concurrent_processes=True), VLLM_SETTINGS, "cpu")


def test_the_cpu_plan_and_engine_are_what_they_were():
    """CPU (the tests, the demo): one process for the three engines, its engine kwargs untouched."""
    labelled = [MeasurementRun(label="no_speculation", speculative_config=None), eagle3_run("trained", Path("d"), 3),
                eagle3_run("untrained", Path("u"), 3)]  # fmt: skip
    settings = evaluation()
    plan = plan_measurements(labelled, settings=settings, vllm_settings=VLLM_SETTINGS, device="cpu",
                             numerics="production")  # fmt: skip
    assert len(plan) == 1
    engine = {"model": "m", "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8}
    assert engine_memory(engine, settings, VLLM_SETTINGS, device="cpu", processes=1) == engine


def test_each_of_n_engines_at_once_gets_its_share_of_the_gpu_and_the_evaluation_kv_cache():
    """The GPU preset's six processes: 0.85 / 6 of the GPU each for vLLM's start-up free-memory check, 4 GiB of KV."""
    engine = {"model": "m", "kv_cache_memory_bytes": 16 * GIB}
    settings = evaluation(kv_cache_memory_bytes=4 * GIB)
    six = engine_memory(engine, settings, GPU_VLLM, device="cuda", processes=6)
    assert six == {"model": "m", "kv_cache_memory_bytes": 4 * GIB, "gpu_memory_utilization": 0.1416}
    assert 6 * six["gpu_memory_utilization"] <= GPU_VLLM.gpu_memory_utilization
    # the arithmetic of engine_memory's docstring: the sixth engine passes the check with five others started
    total_gib, held_gib = 139.8, 7.0
    assert total_gib - 5 * held_gib >= six["gpu_memory_utilization"] * total_gib
    # one after another: the kwargs of today (vLLM's own fraction for its check), only the KV cache is evaluation's
    alone = {"model": "m", "kv_cache_memory_bytes": 4 * GIB}
    assert engine_memory(engine, settings, GPU_VLLM, device="cuda", processes=1) == alone
    profiled = {"model": "m", "gpu_memory_utilization": 0.85}  # no fixed KV cache: vLLM fills its share
    halves = engine_memory(profiled, evaluation(), GPU_VLLM, device="cuda", processes=2)
    assert halves == {"model": "m", "gpu_memory_utilization": 0.425}
    assert engine_memory(profiled, settings, GPU_VLLM, device="cuda", processes=1) == alone


# ---------------------------------------------------------------- which lock each pass holds (one process, fake vLLM)


def test_only_a_timing_pass_holds_the_lock_alone():
    assert LOCK_MODES == {"import": "shared", "engine_start": "shared", "lossless": "shared", "timing": "exclusive"}


class _Completion:
    def __init__(self):
        self.token_ids, self.logprobs, self.finish_reason = [5, 6], None, "length"


def _fake_vllm(calls: list, gate: Gate | None) -> types.ModuleType:
    """vllm.LLM and SamplingParams that record each call with the mode of the lock the process holds then."""
    module = types.ModuleType("vllm")

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("engine_start", gate.mode if gate else None))

        def generate(self, prompts, sampling, use_tqdm=None):
            what = "warm_up" if sampling.max_tokens == 4 else "lossless" if sampling.logprobs else "timing"
            calls.append((what, gate.mode if gate else None))
            return [types.SimpleNamespace(outputs=[_Completion()]) for _ in prompts]

        def get_metrics(self):
            return []

    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module


def _use_fake_vllm(monkeypatch, calls: list, gate: Gate | None) -> None:
    """_fake_vllm as this process's vllm; the test process's heap is not frozen before the fake engine starts
    (serving.cpu_server.freeze_heap_for_cpu_engine, tested in tests/unit/test_extraction.py)."""
    monkeypatch.setitem(sys.modules, "vllm", _fake_vllm(calls, gate))
    monkeypatch.setattr(
        "eagle3_workflow.serving.cpu_server.freeze_heap_for_cpu_engine", lambda tensor_parallel_size: False
    )


def _spec(**values) -> MeasurementSpec:
    fields = dict(engine={"model": "m", "tensor_parallel_size": 1}, prompts=[[1, 2], [3]], max_tokens=3, timing_repeats=1, runs=[],
                  timing_concurrency=[1, 2], timing_prompts=2)  # fmt: skip
    return MeasurementSpec(**(fields | values))


@pytest.mark.parametrize(
    ("passes", "expected"),
    [
        ({"lossless_pass": False}, [("engine_start", "shared"), ("warm_up", "shared"), ("warm_up", "exclusive"),
                                    ("timing", "exclusive"), ("timing", "exclusive"), ("timing", "exclusive")]),
        ({"timing_pass": False}, [("engine_start", "shared"), ("warm_up", "shared"), ("lossless", "shared")]),
        ({}, [("engine_start", "shared"), ("warm_up", "shared"), ("lossless", "shared"), ("warm_up", "exclusive"),
              ("timing", "exclusive"), ("timing", "exclusive"), ("timing", "exclusive")]),
    ],
)  # fmt: skip
def test_engine_start_and_lossless_pass_hold_the_lock_shared_and_the_timing_pass_alone(
    monkeypatch, tmp_path, passes, expected
):
    gate = Gate(str(tmp_path / "measure.lock"))
    gate.hold("import")
    calls: list = []
    _use_fake_vllm(monkeypatch, calls, gate)
    run = MeasurementRun(label="no_speculation", speculative_config=None, **passes)
    result = measure_run(_spec(runs=[run]), run, None, gate)
    assert calls == expected
    assert [t.concurrency for t in result.timings] == ([1, 2] if "lossless_pass" in passes or not passes else [])
    assert set(gate.waited_s) == ({"shared", "exclusive"} if len(expected) > 3 else {"shared"})


def test_without_a_lock_path_the_passes_are_those_of_a_process_alone(monkeypatch):
    """No lock file (CPU, one process): no lock, and the one warm-up before the lossless and timing passes."""
    calls: list = []
    _use_fake_vllm(monkeypatch, calls, None)
    run = MeasurementRun(label="no_speculation", speculative_config=None)
    measure_run(_spec(runs=[run]), run, None)
    assert [what for what, _ in calls] == ["engine_start", "warm_up", "lossless", "timing", "timing", "timing"]


# ---------------------------------------------------------------- real processes against a stand-in vLLM (CPU)

FAKE_ENGINE_HANG_S = 120  # seconds, an engine start that hangs (FAKE_VLLM_HANG=<label>)
FAKE_VLLM = '''
"""A stand-in for vLLM (tests/unit/test_evaluation_concurrency.py): engines that sleep and log what they did."""
import json, os, time

HANG_S = FAKE_ENGINE_HANG_S
__version__ = "0.0.fake"


def _log(label, what, start):
    line = json.dumps({"pid": os.getpid(), "label": label, "what": what, "start": start, "end": time.time()})
    fd = os.open(os.environ["FAKE_VLLM_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\\n").encode())
    os.close(fd)


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self):
        self.token_ids, self.logprobs, self.finish_reason = [5, 6, 7], None, "length"


class _Request:
    def __init__(self):
        self.outputs = [_Completion()]


def _wait_for_the_others():
    """FAKE_VLLM_AT_ONCE=N: an engine start returns once N processes are in theirs (a state, not a clock: however
    slow the machine, processes started at once overlap here), or after 60 s, so that engines started one after
    another show as not overlapping."""
    count = int(os.environ.get("FAKE_VLLM_AT_ONCE", "0"))
    if not count:
        return
    starting = os.environ["FAKE_VLLM_EVENTS"] + ".starting"
    os.makedirs(starting, exist_ok=True)
    open(os.path.join(starting, str(os.getpid())), "w").close()
    deadline = time.time() + 60
    while len(os.listdir(starting)) < count and time.time() < deadline:
        time.sleep(0.05)


class LLM:
    def __init__(self, **kwargs):
        start = time.time()
        self.label = os.path.basename((kwargs.get("speculative_config") or {}).get("model", "no_speculation"))
        if self.label == os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(f"the fake engine {self.label} refused to start")
        time.sleep(HANG_S if self.label == os.environ.get("FAKE_VLLM_HANG") else 0.3)
        _wait_for_the_others()
        _log(self.label, "engine_start", start)

    def generate(self, prompts, sampling, use_tqdm=None):
        start = time.time()
        what = "warm_up" if sampling.max_tokens == 4 else "lossless" if sampling.logprobs else "timing"
        bar = use_tqdm(total=len(prompts)) if use_tqdm else None
        for _ in prompts:
            time.sleep(0.2 if what == "lossless" else 0.02)
            if bar is not None:
                bar.update(1)
        _log(self.label, what, start)
        return [_Request() for _ in prompts]

    def get_metrics(self):
        return []
'''.replace("FAKE_ENGINE_HANG_S", str(FAKE_ENGINE_HANG_S))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The stand-in first on the measurement processes' PYTHONPATH; its event log."""
    package = tmp_path / "fake_site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    # the stand-in's platform is the CPU (serving.cpu_server.freeze_heap_for_cpu_engine asks vllm.platforms)
    (package / "platforms.py").write_text(
        "class _Cpu:\n    def is_cpu(self):\n        return True\n\n\ncurrent_platform = _Cpu()\n"
    )
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH")) if p)
    )
    monkeypatch.setenv("FAKE_VLLM_EVENTS", str(events))
    return events


def _evaluation(tmp_path: Path, **values) -> Evaluation:
    settings = evaluation(concurrent_processes=True, max_tokens=3, timing_repeats=1, timing_concurrency=[1, 2],
                          timing_prompts=2, timeout_s=60, **values)  # fmt: skip
    prompts = PromptSet(prompts=[EvalPrompt(origin=f"p{i}", token_ids=[1, 2, i]) for i in range(10)], source="test",
                        detail="", requested=10, notes=[])  # fmt: skip
    # a 1 s stall floor: a timing process waiting ~2 s for the lossless pass must not read as stalled
    vllm_settings = VLLM_SETTINGS.model_copy(update={"stall_timeout_s": 1})
    return Evaluation(settings, vllm_settings, "cpu", prompts, StopSet(token_ids=[2], strings=[], end_of_turn=""),
                      tmp_path / "work", concurrent=True)  # fmt: skip


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(folder.name.encode())
    return folder


def _plan(tmp_path: Path, draft: str) -> list[PlannedProcess]:
    timing = {"lossless_pass": False}
    return [
        PlannedProcess(runs=[MeasurementRun(label="no_speculation", speculative_config=None, **timing)],
                       batch_invariant=False),
        PlannedProcess(runs=[eagle3_run(draft, _model(tmp_path / draft), 3).model_copy(update=timing)],
                       batch_invariant=False),
        PlannedProcess(runs=[MeasurementRun(label="no_speculation", speculative_config=None, timing_pass=False)],
                       batch_invariant=True),
    ]  # fmt: skip


def test_processes_at_once_never_time_beside_another_process_and_a_rerun_reuses_them(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_AT_ONCE", "3")  # each engine start waits for the other two processes' (above)
    evaluation_ = _evaluation(tmp_path)
    engine = {"model": str(_model(tmp_path / "target")), "enforce_eager": True, "tensor_parallel_size": 1}
    log_path = tmp_path / "evaluate.log"
    measured = measure_runs(_plan(tmp_path, "trained"), engine, evaluation_, log_path=log_path)
    assert measured.concurrent
    assert sorted(measured.timing) == ["no_speculation", "trained"] and list(measured.lossless) == ["no_speculation"]
    assert [t.concurrency for t in measured.timing["trained"].timings] == [1, 2]
    assert [sorted(p.lock_wait_s) for p in measured.processes] == [["exclusive", "shared"]] * 2 + [["shared"]]

    events = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert len({e["pid"] for e in events}) == 3  # three processes
    starts = [e for e in events if e["what"] == "engine_start"]
    assert max(e["start"] for e in starts) < min(e["end"] for e in starts)  # started at once
    for pid in {e["pid"] for e in events if e["what"] == "timing"}:
        mine = [e for e in events if e["pid"] == pid and e["what"] == "timing"]
        begin, end = min(e["start"] for e in mine), max(e["end"] for e in mine)
        beside = [e for e in events if e["pid"] != pid and e["start"] < end and e["end"] > begin]
        assert beside == [], f"a timing pass of {mine[0]['label']} overlapped {beside}"
    log = log_path.read_text()
    assert "[eval-vllm trained.timing] " in log and "[eval-vllm no_speculation.lossless] " in log
    assert "lock exclusive for timing after" in log

    rerun = measure_runs(_plan(tmp_path, "trained"), engine, evaluation_, log_path=log_path)
    assert rerun.processes == [] and sorted(rerun.timing) == ["no_speculation", "trained"]  # every engine reused


def test_a_failing_process_fails_the_stage_with_its_traceback_and_stops_the_others(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "broken")
    monkeypatch.setenv("FAKE_VLLM_HANG", "no_speculation")  # its engines would start for 2 minutes
    started = time.monotonic()
    with pytest.raises(StageError) as failure:
        measure_runs(_plan(tmp_path, "broken"), {"model": str(_model(tmp_path / "target")), "enforce_eager": True,
                      "tensor_parallel_size": 1},
                     _evaluation(tmp_path),
                     log_path=tmp_path / "evaluate.log")  # fmt: skip
    # the hanging ones were stopped, not waited for: on any day well under the hang (an engine that starts: 0.3 s)
    assert time.monotonic() - started < FAKE_ENGINE_HANG_S - 20
    message = str(failure.value)
    assert "exited with code 1" in message
    assert "Traceback (most recent call last)" in message
    assert "RuntimeError('the fake engine broken refused to start')" in message
    assert "measure_0, measure_2 stopped because measure_1 failed" in message
