"""On a GPU machine only (skipped elsewhere): `reference.device: cuda` runs the same fp32 reference as the CPU, at
every depth of the INT4 Kimi-K2.5 stand-in and a tiny Llama (bench/gpu/reference_device_check.py derives the bound
and runs the same comparison without pytest, as the lent machine does)."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, load_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent GPU machine)"),
]


def check_module():
    return load_script(REPO / "bench/gpu/reference_device_check.py")


def test_the_reference_on_cuda_is_the_cpu_reference(tmp_path):
    check = check_module()
    for name, target in check.build_targets(tmp_path).items():
        result = check.compare(target)
        assert result["passed"], f"{name}: {result}"
