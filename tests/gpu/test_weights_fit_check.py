"""bench/gpu/weights_fit_check.py, serving/fit.py's check against the real nvidia-smi and driver of the lent machine:
here its checks run against a fake nvidia-smi and CUDA's figure given, so that a device call is never spent on the
script's own mistake; on a GPU machine the real thing runs."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, load_script

MIB = 2**20
H100_MIB = 81559  # nvidia-smi's memory.total of the lent H100 (docs/gpu.md)


def check_module():
    return load_script(REPO / "bench/gpu/weights_fit_check.py")


def fake_nvidia_smi(tmp_path, monkeypatch, mib: int) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '0, {mib}\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_every_check_passes_where_nvidia_smi_and_cuda_agree(tmp_path, monkeypatch):
    check = check_module()
    fake_nvidia_smi(tmp_path, monkeypatch, H100_MIB)
    monkeypatch.setattr(check, "cuda_totals", lambda: {0: H100_MIB * MIB - 4096})  # below by less than a MiB
    checks = check.run_checks(tmp_path / "work")
    assert {name: c["passed"] for name, c in checks.items()} == dict.fromkeys(
        ["gpu_read", "visible_devices", "refused", "fits_at_2", "kv_cache_too_large"], True)  # fmt: skip
    assert "extraction.tensor_parallel_size = 1" in checks["refused"]["message"]


def test_a_gpu_read_below_what_cuda_reports_fails_the_script(tmp_path, monkeypatch):
    """nvidia-smi's figure 10 MiB below CUDA's: the check would plan with less than the GPU has (a refusal of a target
    that fits is possible), beyond its rounding to whole MiB."""
    check = check_module()
    fake_nvidia_smi(tmp_path, monkeypatch, H100_MIB - 10)
    monkeypatch.setattr(check, "cuda_totals", lambda: {0: H100_MIB * MIB})
    checks = check.run_checks(tmp_path / "work")
    assert not checks["gpu_read"]["passed"]
    assert checks["gpu_read"]["lenient_by_bytes"] == -10 * MIB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent GPU machine)")
def test_on_this_gpu(tmp_path):
    checks = check_module().run_checks(tmp_path)
    assert all(c["passed"] for c in checks.values()), checks
