"""serving/fit.py: a target whose weights cannot fit its ranks' GPUs is refused before any engine starts, with the
tensor-parallel size that would fit; a target that could start is never refused."""

from __future__ import annotations

import json
import os
import struct

import pytest
from conftest import REPO, load_script, tiny_settings

from eagle3_workflow.files.target_weights import safetensors_header, weight_files
from eagle3_workflow.serving.fit import (
    check_weights_fit,
    read_headers,
    served_weight_bytes,
    smallest_gpu_bytes,
    weights_fit,
)
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ServingStage

GIB = 2**30


def write_checkpoint(folder, tensors: dict[str, tuple[str, list[int]]], name: str = "model.safetensors") -> None:
    """A safetensors file in the exact format (8 bytes of header length, the JSON header, the data)."""
    widths = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, (dtype, shape) in tensors.items():
        size = widths[dtype]
        for n in shape:
            size *= n
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_weights_are_counted_as_served_floats_at_the_serving_width_packed_ints_as_stored(tmp_path):
    write_checkpoint(tmp_path, {"embed": ("F32", [100, 8]), "w_packed": ("I32", [16, 4]), "scale": ("BF16", [16]),
                                "shape": ("I64", [2])}, name="model-00001-of-00002.safetensors")  # fmt: skip
    write_checkpoint(tmp_path, {"lm_head": ("BF16", [100, 8])}, name="model-00002-of-00002.safetensors")
    headers = read_headers(tmp_path)
    assert len(headers) == 2
    # with an index, only the files it names: a stray copy beside the shards is not the model's
    write_checkpoint(tmp_path, {"lm_head": ("BF16", [100, 8])}, name="consolidated.safetensors")
    assert len(read_headers(tmp_path)) == 3
    weight_map = {"embed": "model-00001-of-00002.safetensors", "w_packed": "model-00001-of-00002.safetensors",
                  "lm_head": "model-00002-of-00002.safetensors"}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert read_headers(tmp_path) == headers
    # fp32 served in bf16: half its stored bytes; packed int4 (int32) and int64 as stored
    assert served_weight_bytes(headers, "bfloat16") == 800 * 2 + 64 * 4 + 16 * 2 + 2 * 8 + 800 * 2
    assert served_weight_bytes(headers, "float32") == 800 * 4 + 64 * 4 + 16 * 4 + 2 * 8 + 800 * 4


def test_the_storys_target_at_tp_1_is_refused_with_the_size_that_fits():
    """Kimi-K2.5 INT4: ~595 GB of weights. At TP 1 on one 80 GiB GPU it would load for minutes and die; the fix names
    the smallest power-of-two size whose ranks hold the weights: 8 (74 GB a rank of the 77 GB vLLM may take at 0.9,
    a lower bound: the KV cache needs room too), as on 141 GiB GPUs."""
    weights = 595 * 10**9
    h100, h200 = 80 * GIB, 141 * GIB
    fit = weights_fit(weights, 1, h100, utilization=0.9, kv_cache_bytes=None)
    assert not fit.fits and fit.smallest_size() == 8
    assert not weights_fit(weights, 4, h200, utilization=0.9, kv_cache_bytes=None).fits
    assert weights_fit(weights, 4, h200, utilization=0.9, kv_cache_bytes=None).smallest_size() == 8
    assert weights_fit(weights, 8, h200, utilization=0.9, kv_cache_bytes=None).fits


def test_the_targets_that_ran_on_the_lent_gpus_fit():
    """Never a refusal of what started: the real-width Kimi stand-in (54.2 GB, 4 GiB KV cache, one H100 of
    79.6 GiB: it served with 58.8 GiB at peak) and the 8B shape (16.06 GB at 0.85 of the H100)."""
    h100 = int(79.6 * GIB)
    assert weights_fit(54_200_000_000, 1, h100, utilization=0.85, kv_cache_bytes=4 * GIB).fits
    assert weights_fit(16_060_000_000, 1, h100, utilization=0.85, kv_cache_bytes=None).fits


def test_check_refuses_with_the_setting_and_its_fix_and_skips_what_it_cannot_read(tmp_path):
    write_checkpoint(tmp_path / "target", {"w": ("BF16", [1024, 1024])})  # 2 MiB
    fit = check_weights_fit(tmp_path / "target", tensor_parallel_size=1, dtype="bfloat16", utilization=0.9,
                            kv_cache_bytes=None, setting="evaluate.tensor_parallel_size", gpu_bytes=4 * 2**20)  # fmt: skip
    assert fit is not None and fit.fits
    with pytest.raises(StageError) as refused:
        check_weights_fit(tmp_path / "target", tensor_parallel_size=1, dtype="bfloat16", utilization=0.9,
                          kv_cache_bytes=None, setting="evaluate.tensor_parallel_size", gpu_bytes=2**20)  # fmt: skip
    message = str(refused.value)
    assert "holds 2.0 MiB of weights as served, 2.0 MiB per rank at evaluate.tensor_parallel_size = 1" in message
    assert "at most 0.9 MiB of one 1.0 MiB GPU" in message
    assert "Fix: set evaluate.tensor_parallel_size to 4 or more" in message
    # nothing to read: no safetensors files (a path that does not exist yet), no GPU
    assert check_weights_fit(tmp_path / "none", tensor_parallel_size=1, dtype="bfloat16", utilization=0.9,
                             kv_cache_bytes=None, setting="x", gpu_bytes=1) is None  # fmt: skip


def fake_nvidia_smi(tmp_path, monkeypatch, rows: str) -> None:
    """nvidia-smi as it answers `--query-gpu=index,memory.total --format=csv,noheader,nounits` (MiB)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{rows}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_the_gpu_is_the_smallest_visible_one(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "0, 81559\\n1, 143771\\n")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert smallest_gpu_bytes() == 81559 * 2**20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert smallest_gpu_bytes() == 143771 * 2**20


def test_a_cuda_server_of_a_target_its_gpu_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    """The wiring: target_server_spec (the canary's, extraction's and online training's servers) on CUDA."""
    from eagle3_workflow.serving.engine import target_server_spec

    write_checkpoint(tmp_path / "target", {"w": ("BF16", [2048, 1024])})  # 4 MiB
    settings = tiny_settings(ServingStage)
    assert settings.vllm.kv_cache_memory_bytes == 256 * 2**20
    fake_nvidia_smi(tmp_path, monkeypatch, "0, 257\\n")  # 1 MiB beside the tiny preset's 256 MiB KV cache
    with pytest.raises(StageError, match=r"Fix: set extraction.tensor_parallel_size to 4 or more"):
        target_server_spec(settings, model=str(tmp_path / "target"), device="cuda")
    assert target_server_spec(settings, model=str(tmp_path / "target"), device="cpu").device == "cpu"
    fake_nvidia_smi(tmp_path / "other", monkeypatch, "0, 200\\n")  # a KV cache larger than the GPU
    with pytest.raises(StageError, match=r"kv_cache_memory_bytes leaves no room for the target's weights"):
        target_server_spec(settings, model=str(tmp_path / "target"), device="cuda")
    fake_nvidia_smi(tmp_path / "large", monkeypatch, "0, 81559\\n")
    assert target_server_spec(settings, model=str(tmp_path / "target"), device="cuda").tensor_parallel_size == 1


def test_the_offline_engines_of_evaluation_and_regeneration_are_refused_naming_their_own_setting(tmp_path, monkeypatch):
    """offline_engine_kwargs, where every offline engine is sized: evaluate_draft's engines (its first step) and
    regeneration's, each refusal naming the key that set the size."""
    from eagle3_workflow.evaluation.launch import measurement_engine_kwargs
    from eagle3_workflow.regenerate.generate import regeneration_engine_kwargs
    from eagle3_workflow.settings.stages import RegenerateResponsesStage

    write_checkpoint(tmp_path / "target", {"w": ("BF16", [2048, 1024])})  # 4 MiB
    fake_nvidia_smi(tmp_path, monkeypatch, "0, 257\\n")  # 1 MiB beside the tiny preset's 256 MiB KV cache
    settings = tiny_settings(ServingStage)
    with pytest.raises(StageError, match=r"Fix: set evaluate.tensor_parallel_size to 4 or more"):
        measurement_engine_kwargs(settings.vllm, target=str(tmp_path / "target"), dtype="bfloat16",
                                  trust_remote_code=False, seed=0, device="cuda", tensor_parallel_size=1,
                                  in_process=True)  # fmt: skip
    regenerate = tiny_settings(RegenerateResponsesStage)
    regenerate = regenerate.model_copy(update={"vllm": regenerate.vllm.model_copy(update={"device": "cuda"})})
    with pytest.raises(StageError, match=r"Fix: set extraction.tensor_parallel_size to 4 or more"):
        regeneration_engine_kwargs(tmp_path / "target", regenerate)


def test_a_single_file_checkpoint_larger_than_this_machine_is_read_by_its_header_never_mapped(tmp_path):
    """safetensors' safe_open maps the whole file: for a 128 GB model.safetensors on this 24 GiB host that map was
    refused ("Cannot allocate memory", 2026-12-06), so the check could not count a target too large for its GPU. The
    header is read instead. The file here: bf16 matrices adding up to twice this machine's memory, their data a hole
    (a sparse file: the same bytes a real checkpoint has, none of them written)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    target = tmp_path / "target"
    path = load_script(REPO / "bench/gpu/weights_fit_check.py").write_sparse_checkpoint(target, 2 * memory)
    count = -(-2 * memory // (8192 * 8192 * 2))  # the script's 8,192 x 8,192 bf16 matrices
    assert path.stat().st_blocks * 512 < 64 * 2**20, "the premise: a sparse file, next to nothing written"
    assert len(weight_files(target)) == count
    with pytest.raises(StageError, match="Fix: set extraction.tensor_parallel_size to 4 or more"):
        check_weights_fit(target, tensor_parallel_size=1, dtype="bfloat16", utilization=1.0, kv_cache_bytes=None,
                          setting="extraction.tensor_parallel_size", gpu_bytes=memory * 2 // 3)  # fmt: skip


def test_a_file_cut_inside_its_header_is_named_with_the_fix(tmp_path):
    write_checkpoint(tmp_path, {"w": ("BF16", [64, 64])})
    whole = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(whole[:20])
    with pytest.raises(StageError, match="cut short.*Fix: copy the checkpoint again"):
        safetensors_header(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(whole[:5])
    with pytest.raises(StageError, match="shorter than its header length"):
        weight_files(tmp_path)
