"""On the lent GPU machine only (skipped elsewhere): the extraction benchmark at a small size, with the stack that
bench/gpu/install.sh puts in /tmp/site. Run there after `source /tmp/site/ENV.sh`:

    python3 -m pytest tests/gpu/test_on_device.py -m gpu

Written after the 2026-11-29 lease ran out; it has not run on a GPU yet (bench/gpu/results/2026-11-29-h200/README.md, "What did not run").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


def cuda_and_vllm() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    try:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    except ValueError:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_and_vllm(), reason="needs a CUDA device and vLLM (the lent H200 machine)"),
]


def test_small_extraction_bench_writes_every_file_at_prefill_speed(tmp_path):
    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "build_8b_shape_target.py"), str(target)]
        + ["--layers", "8", "--hidden", "1024", "--vocab", "8192"],
        check=True,
    )
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "bench_gpu.py"), "--target", str(target)]
        + ["--work", str(tmp_path / "work"), "--samples", "32", "--seq-len", "1024", "--skip-train", "--eager"]
        + ["--out", str(out)],
        check=True,
        timeout=900,
    )
    extraction = json.loads(out.read_text())["extraction"]
    payload = 32 * 1024 * 4 * 1024 * 2  # samples x tokens x layers x hidden x bf16
    assert payload <= extraction["bytes_per_run"] < payload * 1.02  # + token ids and headers
    assert extraction["ratios"]["workflow_vs_connector"] > 0.9
