"""The full-depth check of validate_hidden_states (eagle3_workflow.validation.full_depth) without vLLM: the streamed reference
equals a plain HF forward at every depth (llama, qwen3, deepseek_v3; sharded checkpoints; samples of different
lengths in one padded batch), the slot verdicts name every wrong id, and a target it cannot run fails the stage with
the cause. Through a real server and Snakemake (a fault past the canary's slice): tests/integration/test_gates_canary.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_settings
from hf_forward import hf_forward_states
from safetensors.torch import save_file

from eagle3_workflow.files.hidden_states import hs_file
from eagle3_workflow.reference.full_depth import UnsupportedTarget, split_by_layer, stream_reference
from eagle3_workflow.reference.layer_match import POST_NORM, SlotMatch
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import ValidateHiddenStatesStage
from eagle3_workflow.target_build.tiny import model_config
from eagle3_workflow.validation.full_depth import (
    check_stage,
    failure_message,
    full_depth_check,
    pick_rows,
    slot_verdicts,
)


def random_target(out: Path, arch: str, num_layers: int, *, shard: str | None = "60KB") -> Path:
    """A random-weight model saved as bf16 safetensors (sharded when `shard` is given: the index is read)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = model_config(arch, num_layers=num_layers, hidden_size=64, head_dim=32, vocab_size=300, bos=0, eos=1, pad=2)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard or "10GB")
    return out


def hf_states(target: Path, ids: list[int]) -> tuple[int, dict[str, torch.Tensor]]:
    """A plain HF fp32 forward of one sample: label -> [T, H] in vLLM's convention (layer_match)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return len(model.model.layers), hf_forward_states(model, ids)


SAMPLES = [list(range(5, 46)), list(range(100, 111)), list(range(200, 203))]  # 41, 11 and 3 tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_streamed_reference_equals_a_plain_hf_forward(tmp_path, arch):
    target = random_target(tmp_path / arch, arch, 4)
    assert (target / "model.safetensors.index.json").exists(), "the test means to read a sharded checkpoint"
    streamed: dict[str, torch.Tensor] = {}
    num_layers, peak = stream_reference(
        target, SAMPLES, lambda label, s: streamed.__setitem__(label, s.clone()), trust_remote_code=False, device="cpu"
    )
    assert num_layers == 4
    assert set(streamed) == {"0", "1", "2", "3", "4", POST_NORM}
    for b, ids in enumerate(SAMPLES):
        _, reference = hf_states(target, ids)
        for label, expected in reference.items():
            got = streamed[label][b, : len(ids)]
            error = float((got - expected).abs().max() / expected.abs().max())
            assert error < 1e-5, f"{arch} sample {b} depth {label}: rel error {error}"
    weights = sum(p.stat().st_size for p in target.glob("*.safetensors")) * 2  # bf16 on disk, fp32 in memory
    assert 0 < peak < weights / 2, "more than one layer (or the embedding) held at once"


def test_split_by_layer_leaves_out_the_head_and_the_mtp_layer():
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.a.weight",
             "model.layers.1.b.weight", "model.layers.2.eh_proj.weight"]  # fmt: skip
    outside, per_layer = split_by_layer(names, 2)
    assert outside == ["model.embed_tokens.weight", "model.norm.weight"]
    assert per_layer == {0: ["model.layers.0.a.weight"], 1: ["model.layers.1.b.weight"]}


def test_pick_rows_takes_the_longest_and_the_shortest():
    assert pick_rows({0: 5, 1: 9, 2: 3, 3: 9, 4: 3}) == [1, 2]
    assert pick_rows({7: 4}) == [7]
    assert pick_rows({}) == []


# ---------------------------------------------------------------- the verdicts


def match(claimed: int, best: str, *, own_rel: float = 0.01) -> SlotMatch:
    runner_up = str(claimed) if best != str(claimed) else str(claimed + 1)
    return SlotMatch(
        claimed=claimed, best=best, best_rel=0.004, runner_up=runner_up, runner_up_rel=0.2, own_rel=own_rel
    )


def test_slot_verdicts_name_a_wrong_layer_and_an_error_above_tolerance():
    matches = [match(2, "2"), match(16, "17", own_rel=0.3), match(29, "29"), match(32, "32")]
    max_rel = {"2": 0.01, "16": 0.4, "29": 0.2, "32": 0.02}
    verdicts = slot_verdicts(matches, max_rel, tolerance=0.05)
    assert [v.ok for v in verdicts] == [True, False, False, True]
    assert verdicts[1].problem == "WRONG LAYER: id 16 is layer 17 (rel 0.004; vs its own layer 0.3)"
    assert verdicts[2].problem == "TOO FAR: id 29 max rel error 0.2 > tolerance 0.05"
    assert verdicts[0].problem == "" and verdicts[0].margin == 50.0


# ---------------------------------------------------------------- the check on files, without vLLM


def write_capture(files_dir: Path, target: Path, samples: dict[int, list[int]], layer_ids: list[int], sources: dict):
    """hs_<row>.safetensors as the connector writes them (bf16 [T, L, H]) from a plain HF forward, each claimed id
    filled from `sources.get(id, id)`: a capture that is right, or wrong where `sources` says."""
    files_dir.mkdir(parents=True, exist_ok=True)
    for row, ids in samples.items():
        _, states = hf_states(target, ids)
        slots = torch.stack([states[str(sources.get(k, k))] for k in layer_ids], dim=1).to(torch.bfloat16)
        save_file({"hidden_states": slots, "token_ids": torch.tensor(ids)}, str(hs_file(files_dir, row)))


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A 12-layer llama: production ids [2, 6, 9, 12], two of them past an 8-layer canary slice."""
    return random_target(tmp_path_factory.mktemp("deep") / "llama-12", "llama", 12)


DEEP_IDS = [2, 6, 9, 12]
DEEP_SAMPLES = {0: SAMPLES[0], 1: SAMPLES[1], 2: SAMPLES[0][:20]}


def test_full_depth_check_passes_a_right_capture(deep_target, tmp_path):
    write_capture(tmp_path / "files", deep_target, DEEP_SAMPLES, DEEP_IDS, {})
    report = full_depth_check(
        deep_target,
        tmp_path / "files",
        DEEP_SAMPLES,
        DEEP_IDS,
        tolerance=0.05,
        max_tokens=32,
        trust_remote_code=False,
        device="cpu",
    )
    assert report.passed, failure_message(report)
    assert report.rows == [0, 1] and report.tokens == [32, 11]  # the longest (cut to max_tokens), the shortest
    assert [s.claimed for s in report.slots] == DEEP_IDS
    assert all(s.best == str(s.claimed) for s in report.slots)
    assert max(s.max_rel_error for s in report.slots) < 0.02  # bf16 rounding only


def test_full_depth_check_names_every_slot_taken_from_the_wrong_depth(deep_target, tmp_path):
    """Past the canary's slice only: id 9 from layer 10, and id 12 (the verifier's) after the final norm."""
    write_capture(tmp_path / "files", deep_target, DEEP_SAMPLES, DEEP_IDS, {9: 10, 12: POST_NORM})
    report = full_depth_check(
        deep_target,
        tmp_path / "files",
        DEEP_SAMPLES,
        DEEP_IDS,
        tolerance=0.05,
        max_tokens=64,
        trust_remote_code=False,
        device="cpu",
    )
    assert report.passed is False
    assert {s.claimed: s.best for s in report.slots if not s.ok} == {9: "10", 12: POST_NORM}
    message = failure_message(report)
    assert "2 of 4 captured ids do not hold their own layer of the 12-layer target" in message
    assert "WRONG LAYER: id 9 is layer 10" in message
    assert "WRONG LAYER: id 12 is layer post-norm" in message
    assert "do not raise the tolerance" in message


def test_an_error_above_tolerance_on_the_right_layers_gets_the_drift_advice(deep_target, tmp_path):
    write_capture(tmp_path / "files", deep_target, DEEP_SAMPLES, DEEP_IDS, {})
    report = full_depth_check(
        deep_target,
        tmp_path / "files",
        DEEP_SAMPLES,
        DEEP_IDS,
        tolerance=1e-4,
        max_tokens=16,
        trust_remote_code=False,
        device="cpu",
    )
    assert report.passed is False
    assert all(s.best == str(s.claimed) for s in report.slots)
    message = failure_message(report)
    assert "TOO FAR: id 2 max rel error" in message
    assert "Every id is nearest to its own layer" in message and "do not raise" not in message


def test_turned_off_the_report_says_unsafe(tmp_path):
    settings = tiny_settings(ValidateHiddenStatesStage, validation={"full_depth_check": False})
    report = check_stage(settings, target_dir=tmp_path, files_dir=tmp_path, samples={0: [1, 2]}, layer_ids=[2, 4, 8])
    assert report.enabled is False and report.passed is None
    assert "UNSAFE" in report.note and report.slots == []


def test_a_failed_check_stops_the_stage_with_its_table(deep_target, tmp_path):
    write_capture(tmp_path / "files", deep_target, DEEP_SAMPLES, DEEP_IDS, {6: 7})
    settings = tiny_settings(ValidateHiddenStatesStage)
    with pytest.raises(StageError, match="WRONG LAYER: id 6 is layer 7"):
        check_stage(settings, target_dir=deep_target, files_dir=tmp_path / "files", samples=DEEP_SAMPLES,
                    layer_ids=DEEP_IDS)  # fmt: skip


# ---------------------------------------------------------------- targets it cannot run: the stage fails and says so


def test_a_quantized_checkpoint_is_refused_with_the_cause(tmp_path):
    target = random_target(tmp_path / "q", "llama", 2, shard=None)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedTarget) as info:
        stream_reference(target, [[5, 6, 7]], lambda *_: None, trust_remote_code=False, device="cpu")
    assert "quantized (compressed-tensors)" in str(info.value)
    assert "validation.full_depth_check: false" in str(info.value)


def test_a_checkpoint_without_a_layer_is_refused_naming_it(tmp_path):
    target = random_target(tmp_path / "cut", "llama", 3, shard=None)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 4  # the checkpoint has layers 0..2 only
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedTarget, match="no tensor of decoder layer 3"):
        stream_reference(target, [[5, 6, 7]], lambda *_: None, trust_remote_code=False, device="cpu")


def test_a_reference_device_this_process_lacks_fails_with_the_fix():
    from eagle3_workflow.reference.full_depth import reference_device

    assert reference_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for one without")
    with pytest.raises(StageError, match=r"reference.device is cuda, but this process sees no CUDA device .*Fix: "):
        reference_device("cuda")
    with pytest.raises(StageError, match=r"reference.device is 'tpu'; it must be one of \['cpu', 'cuda'\]"):
        reference_device("tpu")


def test_the_reference_device_reaches_the_report(deep_target, tmp_path):
    """reference.device through full_depth_check: cpu recorded in the report; cuda on a machine without one refused
    with the fix before any layer is read."""
    write_capture(tmp_path / "files", deep_target, DEEP_SAMPLES, DEEP_IDS, {})
    check = dict(tolerance=0.05, max_tokens=16, trust_remote_code=False)
    report = full_depth_check(deep_target, tmp_path / "files", DEEP_SAMPLES, DEEP_IDS, device="cpu", **check)
    assert report.passed and report.reference_device == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for one without")
    with pytest.raises(StageError, match="reference.device is cuda, but this process sees no CUDA device"):
        full_depth_check(deep_target, tmp_path / "files", DEEP_SAMPLES, DEEP_IDS, device="cuda", **check)
