"""train_draft: command building, metrics parsing, the work directory, and real CPU training runs.

The hidden states come from HF transformers on the tiny target (not from the extraction stage), with vLLM's
layer-id convention: id k in 1..N-1 = HF ``hidden_states[k]``, id N = the last decoder layer's pre-norm output.
Training runs speculators' real trainer through the CPU shim.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_workflow.contracts import process_umask
from eagle3_workflow.cpu_train_shim import SHIM_PATCH_POINTS, shim_patch_points_present, with_cpu_defaults
from eagle3_workflow.errors import StageError
from eagle3_workflow.runtime.child import first_traceback
from eagle3_workflow.settings import TrainSettings, with_schema_defaults
from eagle3_workflow.training.command import (
    TRAINER_FIELDS_USED,
    TrainDevice,
    TrainPaths,
    build_train_command,
    resolve_device,
)
from eagle3_workflow.training.launcher import trainer_env
from eagle3_workflow.training.metrics import metrics_table, read_metric_lines
from eagle3_workflow.training.stage import train_draft
from eagle3_workflow.training.workdir import (
    drop_incomplete_checkpoints,
    latest_checkpoint,
    reconcile_work_dir,
    stage_training_data,
)

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "workflow" / "scripts"
NUM_LAYERS = 8
LAYER_IDS = [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]  # EAGLE-3's capture for 8 layers
TRAIN = {
    "gpus": 0,
    "draft_vocab_size": 256,
    "lr": 0.003,
    "epochs": 2,
    "total_seq_len": 512,
    "train_data_ratio": 0.75,
    "num_workers": 0,
    "seed": 0,
}


def train_settings(values: dict) -> TrainSettings:
    """The train section setting `values`, the schema's defaults elsewhere."""
    return TrainSettings.model_validate(with_schema_defaults(train=values)["train"])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Inputs: a prepared dataset and hidden-state files made with HF transformers


def write_hidden_states(target: Path, prepared: Path, files_dir: Path, layer_ids: list[int]) -> tuple[int, int]:
    import datasets
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("pre_norm", out[0] if isinstance(out, tuple) else out)
    )
    files_dir.mkdir(parents=True, exist_ok=True)
    dataset = datasets.load_from_disk(str(prepared))
    with torch.inference_mode():
        for row in range(len(dataset)):
            ids = dataset[row]["input_ids"].to(torch.int64)
            out = model(input_ids=ids[None], output_hidden_states=True)
            layers = [out.hidden_states[k][0] if k < num_layers else captured["pre_norm"][0] for k in layer_ids]
            hidden = torch.stack(layers, dim=1).to(torch.bfloat16).contiguous()  # [T, L, H]
            save_file(
                {"hidden_states": hidden, "token_ids": ids.contiguous()}, str(files_dir / f"hs_{row}.safetensors")
            )
    hook.remove()
    return len(dataset), model.config.hidden_size


@pytest.fixture(scope="module")
def train_inputs(tiny_targets, tmp_path_factory):
    """target, prepared/, token_freq.pt, hidden-state files, api_compat.json and validation.json."""
    from conftest import TINY_DATA, preparation
    from transformers import AutoTokenizer

    from eagle3_workflow.prepare import prepare_conversations, write_prepared

    root = tmp_path_factory.mktemp("train_inputs")
    target = tiny_targets("llama", NUM_LAYERS)
    tokenizer = AutoTokenizer.from_pretrained(target)
    result = prepare_conversations([(TINY_DATA, "sharegpt")], tokenizer, preparation(max_seq_len=256, max_samples=24))
    write_prepared(result, root / "prepared", root / "token_freq.pt")
    rows, hidden_size = write_hidden_states(target, root / "prepared", root / "files", LAYER_IDS)
    (root / "api_compat.json").write_text(json.dumps({"passed": True, "layer_ids": LAYER_IDS}))
    (root / "validation.json").write_text(
        json.dumps(
            {
                "passed": True,
                "samples_expected": rows,
                "samples_valid": rows,
                "missing": [],
                "bad": {},
                "layer_count": len(LAYER_IDS),
                "hidden_size": hidden_size,
            }
        )
    )
    return {
        "target": target,
        "prepared": root / "prepared",
        "token_freq": root / "token_freq.pt",
        "files_dir": root / "files",
        "api_compat": root / "api_compat.json",
        "validation": root / "validation.json",
    }


def run_training(inputs: dict, tmp: Path, **train_overrides) -> object:
    settings = train_settings({**TRAIN, **train_overrides})
    return train_draft(
        settings, **inputs, work_dir=tmp / "train_work", out_dir=tmp / "draft", trust_remote_code=False, cpu_threads=2
    )


# ---------------------------------------------------------------------------------------------------------------
# Command building


def paths(tmp: Path = Path("/w")) -> TrainPaths:
    return TrainPaths.in_work_dir(tmp / "train_work", Path("/models/target"), 512)


def value_of(command: list[str], flag: str) -> list[str]:
    i = command.index(flag)
    values = []
    for item in command[i + 1 :]:
        if item.startswith("--"):
            break
        values.append(item)
    return values


def test_cpu_command_maps_the_config_and_uses_the_shim():
    settings = train_settings(
        {
            **TRAIN,
            "draft_vocab_size": 512,
            "ttt_steps": 5,
            "draft_layers": 2,
            "optimizer": "muon",
            "extra_args": ["--log-freq", "2"],
        }
    )
    command = build_train_command(
        settings, paths(), TrainDevice("cpu"), target_layer_ids=[2, 4, 5], python="py", trust_remote_code=False
    )
    assert command[:3] == ["py", "-m", "eagle3_workflow.trainer_entry"]
    assert value_of(command, "--target-layer-ids") == ["2", "4", "5"]
    assert value_of(command, "--num-layers") == ["2"]
    assert value_of(command, "--ttt-steps") == ["5"]
    assert value_of(command, "--draft-vocab-size") == ["512"]
    assert value_of(command, "--optimizer") == ["muon"]
    assert value_of(command, "--lr") == ["0.003"]
    assert value_of(command, "--epochs") == ["2"]
    assert value_of(command, "--total-seq-len") == ["512"]
    assert value_of(command, "--train-data-ratio") == ["0.75"]
    assert value_of(command, "--num-workers") == ["0"]
    assert value_of(command, "--seed") == ["0"]
    assert value_of(command, "--data-path") == ["/w/train_work/data"]
    assert value_of(command, "--save-path") == ["/w/train_work/checkpoints"]
    assert value_of(command, "--d2t-path") == ["/w/train_work/data/d2t-512.npy"]
    assert value_of(command, "--on-missing") == ["raise"]  # never call a vLLM server from the trainer
    assert value_of(command, "--draft-attn-impl") == ["sdpa"]
    assert value_of(command, "--loss-implementation") == ["eager"]
    assert "--trust-remote-code" not in command
    assert command[-2:] == ["--log-freq", "2"]  # extra args last: they win


def test_gpu_commands_use_speculators_defaults_and_torchrun_for_several_gpus():
    settings = train_settings({**TRAIN, "gpus": 8})
    single = build_train_command(
        settings, paths(), TrainDevice("cuda", 1), target_layer_ids=[2, 4, 5], python="py", trust_remote_code=False
    )
    assert single[:3] == ["py", "-m", "eagle3_workflow.trainer_entry"]
    assert "--draft-attn-impl" not in single and "--loss-implementation" not in single  # flex + fused
    multi = build_train_command(
        settings, paths(), TrainDevice("cuda", 8), target_layer_ids=[2, 4, 5], python="py", trust_remote_code=True
    )
    assert multi[:8] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=8",
        "-m",
        "eagle3_workflow.trainer_entry",
        "--speculator-type",
    ]
    assert "--trust-remote-code" in multi


def test_command_resolves_in_speculators_own_config():
    """Every flag exists in the installed speculators and lands in the field we mean."""
    from speculators.train.config import TrainConfig

    settings = train_settings({**TRAIN, "checkpoint_freq": 0.5})
    command = build_train_command(
        settings, paths(), TrainDevice("cpu"), target_layer_ids=[2, 4, 5], trust_remote_code=False
    )
    flat = TrainConfig.resolve(command[3:]).flatten()
    assert flat["target_layer_ids"] == [2, 4, 5]
    assert flat["draft_vocab_size"] == 256 and flat["epochs"] == 2 and flat["lr"] == 0.003
    assert flat["checkpoint_freq"] == 0.5 and flat["train_data_ratio"] == 0.75
    assert flat["draft_attn_impl"] == "sdpa" and flat["loss_implementation"] == "eager"
    assert flat["on_missing"] == "raise" and flat["speculator_type"] == "eagle3"
    used = {a[2:].replace("-", "_") for a in command[3:] if a.startswith("--")}
    assert used <= set(TRAINER_FIELDS_USED) <= set(flat)


def test_device_follows_gpus_and_what_is_visible():
    assert resolve_device(0, 8) == TrainDevice("cpu", 1)
    assert resolve_device(8, 0) == TrainDevice("cpu", 1)
    assert resolve_device(4, 8) == TrainDevice("cuda", 4)
    with pytest.raises(StageError, match="only 2 CUDA"):
        resolve_device(8, 2)


def test_shim_patch_points_exist_and_cpu_defaults_do_not_override():
    rows = shim_patch_points_present()
    assert [name for name, _, _ in rows] == [f"{m}:{a}" for m, a in SHIM_PATCH_POINTS]
    assert all(present for _, present, _ in rows), rows
    assert with_cpu_defaults(["--x", "1"])[-4:] == ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    assert with_cpu_defaults(["--draft-attn-impl=eager"]).count("--draft-attn-impl") == 0


def test_the_trainer_entry_applies_the_cpu_shim_only_on_cpu():
    from eagle3_workflow.trainer_entry import DEVICE_ENV, METRICS_ENV

    assert trainer_env(TrainDevice("cpu"), 2)[DEVICE_ENV] == "cpu"
    assert DEVICE_ENV not in trainer_env(TrainDevice("cuda", 1), 2)
    assert trainer_env(TrainDevice("cuda", 1), 2).get("COLUMNS") == os.environ.get("COLUMNS")  # no forced width
    assert METRICS_ENV not in trainer_env(TrainDevice("cpu"), 2)  # set per attempt by run_attempt


# ---------------------------------------------------------------------------------------------------------------
# Metrics: speculators' metric records, written by the trainer entry's handler

LOG = r"""
import json, logging, sys
from pathlib import Path
from speculators.train import cli
from speculators.train.logger import log_run_config, setup_root_logger
from eagle3_workflow.trainer_entry import install_metric_handler
out, rank, attempt = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
install_metric_handler(out, rank)
# what speculators' cli.main does first (the name it calls, which the entry wraps)
setup_root_logger()
cli.setup_metric_logger(loggers="", run_name=None, output_dir=str(out.parent))
logging.getLogger("speculators.metrics").info({"lr": 0.1, "epochs": 2}, extra={"hparams": True})
metrics = logging.getLogger("speculators.metrics")
for kind, payload, step in attempt:
    if kind == "text":
        logging.getLogger("speculators").info(payload)
    else:
        metrics.info(payload, extra={"step": step})
"""


def train_record(step: int, epoch: int, loss: float) -> list:
    train = {f"loss_{k}": loss / 3 for k in range(3)} | {f"full_acc_{k}": 0.1 * (k + 1) for k in range(3)}
    train |= {f"cond_acc_{k}": 0.5 for k in range(3)} | {"loss": loss, "error_records": 0.0}
    profile = {"fetch_ms": 12.5, "step_ms": 803.0, "tokens_per_s": 1234.5}
    record = {"train": train, "profile": profile, "epoch": epoch, "lr": 0.00075, "global_step": step}
    return ["metrics", record, step]


def val_record(epoch: int, loss: float, steps_done: int) -> list:
    val = {f"loss_{k}_epoch": loss / 3 for k in range(3)} | {f"full_acc_{k}_epoch": 0.2 for k in range(3)}
    return ["metrics", {"val": val | {"loss_epoch": loss}, "epoch": epoch}, steps_done]


def log_through_speculators(out: Path, attempt: list, rank: int = 0) -> list[dict]:
    """Records logged through speculators' real logger setup in a trainer-like process with the entry's handler."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-c", LOG, str(out), str(rank), json.dumps(attempt)], env=env, capture_output=True, check=True
    )
    return read_metric_lines(out)


@pytest.fixture(scope="module")
def logged_attempts(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    first = [
        ["text", "Starting fresh training run.", None],
        train_record(0, 0, 6.0),
        train_record(1, 0, 5.0),
        ["text", "Saving checkpoint to /x/0", None],
        val_record(0, 4.5, 2),
        train_record(2, 1, 4.8),
    ]
    second = [
        ["text", "Resuming training on epoch 1.", None],
        train_record(2, 1, 4.4),
        train_record(3, 1, 4.0),
        val_record(1, 3.9, 4),
    ]
    return [log_through_speculators(root / f"metrics-attempt-{n}.jsonl", a) for n, a in enumerate([first, second])]


def test_metric_records_become_one_row_per_step_and_validation(logged_attempts):
    assert len(logged_attempts[0]) == 4  # the metric dicts with a step; no text, no hyperparameters
    frame = metrics_table(logged_attempts[:1])
    assert list(frame["split"]) == ["train", "train", "val", "train"]
    assert list(frame["global_step"]) == [0, 1, 2, 2]  # validation: steps done when it ran
    assert list(frame.columns[:5]) == ["attempt", "split", "epoch", "global_step", "loss"]
    assert {"loss_0", "loss_2", "full_acc_0", "full_acc_2", "cond_acc_1", "lr", "tokens_per_s"} <= set(frame.columns)
    first = frame.iloc[0]
    assert first["loss"] == pytest.approx(6.0) and first["loss_1"] == pytest.approx(2.0)
    # the values themselves, not a console rendering rounded to 3 decimals
    assert first["full_acc_2"] == 0.1 * 3 and first["lr"] == 0.00075
    assert first["tokens_per_s"] == 1234.5 and first["error_records"] == 0.0
    assert frame.iloc[2]["loss"] == pytest.approx(4.5) and frame.iloc[2]["full_acc_1"] == pytest.approx(0.2)


def test_resumed_steps_come_from_the_last_attempt(logged_attempts):
    frame = metrics_table(logged_attempts)
    train = frame[frame["split"] == "train"]
    assert list(train["global_step"]) == [0, 1, 2, 3]
    assert list(train["attempt"]) == [1, 1, 2, 2]
    assert train.iloc[2]["loss"] == pytest.approx(4.4)  # the rerun's step 2, not the killed one's
    assert list(frame[frame["split"] == "val"]["epoch"]) == [0, 1]


def test_only_rank_0_writes_metrics(tmp_path):
    assert log_through_speculators(tmp_path / "rank1.jsonl", [train_record(0, 0, 6.0)], rank=1) == []
    assert not (tmp_path / "rank1.jsonl").exists()


def test_the_entry_refuses_a_speculators_whose_main_no_longer_sets_up_the_metric_logger(monkeypatch, tmp_path):
    import speculators.train.cli as cli

    from eagle3_workflow.trainer_entry import install_metric_handler

    def main_of_another_version(cfg):
        return cfg

    monkeypatch.setattr(cli, "main", main_of_another_version)
    with pytest.raises(RuntimeError, match="no longer calls setup_metric_logger"):
        install_metric_handler(tmp_path / "m.jsonl", 0)
    assert install_metric_handler(tmp_path / "m.jsonl", 1) is False  # other ranks write nothing


def test_a_line_cut_short_by_a_kill_is_skipped_and_no_records_give_an_empty_table(tmp_path):
    cut = tmp_path / "metrics-attempt-01.jsonl"
    cut.write_text(json.dumps({"step": 0, "metrics": train_record(0, 0, 6.0)[1]}) + '\n{"step": 1, "metr')
    assert [r["step"] for r in read_metric_lines(cut)] == [0]
    assert read_metric_lines(tmp_path / "absent.jsonl") == []
    assert metrics_table([[], [{"step": 3, "metrics": {"note": "x"}}]]).empty


def test_first_traceback_is_quoted_to_its_exception_line():
    lines = [
        "noise",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "x.py", line 1, in <module>',
        "[rank0]:     main()",
        "[rank0]: ValueError: bad ids",
        "more noise",
        "Traceback (most recent call last):",
        "  File ...",
        "KeyError: 2",
    ]
    quoted = first_traceback(lines)
    assert quoted.splitlines()[0] == "Traceback (most recent call last):"
    assert quoted.splitlines()[-1] == "ValueError: bad ids"
    assert first_traceback(["all", "fine"]) == ""


# ---------------------------------------------------------------------------------------------------------------
# The work directory


def test_work_dir_is_kept_for_the_same_inputs_and_cleared_for_others(tmp_path):
    work = tmp_path / "train_work"
    assert reconcile_work_dir(work, {"settings": {"lr": 1}}) is False
    (work / "checkpoints" / "0").mkdir(parents=True)
    assert reconcile_work_dir(work, {"settings": {"lr": 1}}) is True
    assert (work / "checkpoints" / "0").is_dir()
    assert reconcile_work_dir(work, {"settings": {"lr": 2}}) is False
    assert not (work / "checkpoints").exists()


def test_fingerprint_follows_the_data_the_target_weights_and_the_settings_that_matter(tmp_path):
    from eagle3_workflow.training.workdir import training_fingerprint

    for name, content in {"target/config.json": "{}", "target/model.safetensors": "w" * 10,
                          "prepared/state.json": "{}", "token_freq.pt": "f", "validation.json": "{}",
                          "files/hs_0.safetensors": "a", "files/hs_1.safetensors": "b"}.items():  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)

    def fingerprint(**train):
        return training_fingerprint(
            train_settings({**TRAIN, **train}), target=tmp_path / "target", prepared=tmp_path / "prepared",
            token_freq=tmp_path / "token_freq.pt", validation=tmp_path / "validation.json",
            files_dir=tmp_path / "files", rows=2, target_layer_ids=[2, 4, 5],
        )  # fmt: skip

    before = fingerprint()
    assert fingerprint(num_workers=8, gpus=4, checkpoint_freq=0.5) == before  # safe to change before a resume
    assert fingerprint(lr=0.1) != before
    (tmp_path / "files" / "hs_1.safetensors").write_text("c")  # re-extracted from other weights
    assert fingerprint() != before
    (tmp_path / "files" / "hs_1.safetensors").write_text("b")
    (tmp_path / "target" / "model.safetensors").write_text("w" * 11)
    assert fingerprint() != before


def fake_checkpoint(directory: Path, epoch: int, *, finished: bool = True) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))
    torch.save({"state": {}}, directory / "optimizer_state_dict.pt")
    if finished:
        (directory / "training_state.json").write_text(
            json.dumps({"epoch": epoch, "local_step": 0, "global_step": 3 * (epoch + 1)})
        )


def test_half_written_checkpoints_are_dropped_so_resume_takes_the_last_complete_one(tmp_path):
    save = tmp_path / "checkpoints"
    fake_checkpoint(save / "0", 0)
    fake_checkpoint(save / "1", 1)
    fake_checkpoint(save / "2", 2, finished=False)  # killed before training_state.json
    (save / "1" / "model.safetensors").write_bytes(b"\x00" * 3)  # ... and one truncated before it
    (save / "epoch0_end").symlink_to("0")
    removed = drop_incomplete_checkpoints(save)
    assert [r.split(":")[0] for r in removed] == ["2", "1"]
    info = latest_checkpoint(save)
    assert info.epoch == 0 and info.global_step == 3


def test_staging_links_the_dataset_token_freq_and_hidden_states(tmp_path):
    prepared, files = tmp_path / "prepared", tmp_path / "files"
    prepared.mkdir()
    files.mkdir()
    (prepared / "state.json").write_text("{}")
    (tmp_path / "token_freq.pt").write_bytes(b"x")
    data = tmp_path / "work" / "data"
    data.mkdir(parents=True)
    (data / "d2t-8.npy").write_bytes(b"keep")
    (data / "stale.arrow").symlink_to(tmp_path / "gone")
    stage_training_data(data, prepared=prepared, token_freq=tmp_path / "token_freq.pt", files_dir=files)
    assert sorted(p.name for p in data.iterdir()) == ["d2t-8.npy", "hidden_states", "state.json", "token_freq.pt"]
    assert (data / "hidden_states").resolve() == files.resolve()
    assert not os.path.isabs(os.readlink(data / "hidden_states"))  # relative: the results tree can move
    with pytest.raises(StageError, match="does not exist"):
        stage_training_data(data, prepared=prepared, token_freq=tmp_path / "token_freq.pt", files_dir=tmp_path / "x")


# ---------------------------------------------------------------------------------------------------------------
# Real training on CPU


@pytest.mark.slow
def test_cpu_training_writes_a_loadable_draft_and_metrics(train_inputs, tmp_path):
    import numpy as np
    import pandas as pd
    from speculators.models.eagle3 import Eagle3DraftModel

    started = time.monotonic()
    summary = run_training(train_inputs, tmp_path)
    elapsed = time.monotonic() - started
    draft = tmp_path / "draft"
    assert {"config.json", "metrics.csv", "model.safetensors", "training.json"} <= {p.name for p in draft.iterdir()}
    assert not (draft / "optimizer_state_dict.pt").exists()
    private = [p.name for p in draft.iterdir() if p.stat().st_mode & 0o044 != 0o044 & ~process_umask()]
    assert not private, f"draft files others in the group cannot read: {private}"
    config = json.loads((draft / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]
    assert config["draft_vocab_size"] == TRAIN["draft_vocab_size"]

    metrics = pd.read_csv(draft / "metrics.csv")
    train = metrics[metrics["split"] == "train"]
    assert list(train["global_step"]) == list(range(len(train))) and len(train) == summary.steps
    assert set(metrics[metrics["split"] == "val"]["epoch"]) == {0, 1}
    assert {"loss_0", "full_acc_0", "full_acc_2", "cond_acc_2"} <= set(metrics.columns)
    assert train["loss"].iloc[-1] < train["loss"].iloc[0]  # it learned something

    model = Eagle3DraftModel.from_pretrained(str(draft))
    d2t = np.load(tmp_path / "train_work" / "data" / f"d2t-{TRAIN['draft_vocab_size']}.npy")
    assert (model.d2t.cpu().numpy() == d2t).all()
    assert summary.resumed_from is None and summary.attempts == 1

    again = run_training(train_inputs, tmp_path)  # a forced rerun: publishes the finished run, trains nothing
    assert again.attempts == 1 and again.final_checkpoint == summary.final_checkpoint
    assert sha256(draft / "model.safetensors") == sha256(
        tmp_path / "train_work" / "checkpoints" / "1" / "model.safetensors"
    )
    print(f"tiny CPU training: {summary.steps} steps, {elapsed:.1f} s (trainer wall {summary.wall_s} s)")


KILL_RUN = r"""
import json, sys
from pathlib import Path
from eagle3_workflow.runtime.stage import run_stage
from eagle3_workflow.settings import TrainSettings, with_schema_defaults
from eagle3_workflow.training.stage import train_draft
spec = json.loads(sys.argv[1])
paths = {k: Path(v) for k, v in spec["paths"].items()}
settings = TrainSettings.model_validate(with_schema_defaults(train=spec["train"])["train"])
run_stage("train_draft", None, lambda log: train_draft(settings, **paths, trust_remote_code=False, cpu_threads=2),
          resumes="the rerun resumes from the last checkpoint")
"""


@pytest.mark.slow
def test_killed_training_resumes_from_its_checkpoint_with_the_same_vocab_mapping(train_inputs, tmp_path):
    import pandas as pd

    # The kill waits for a state (epoch 0's checkpoint complete), never a clock. What must not happen is the whole
    # stage finishing first (it did once in CI with 2 epochs: one epoch of 3 steps was left when the checkpoint
    # appeared). With 4 epochs, 9 steps, 3 validations and 3 checkpoint saves (>= 10 s here) are left at that
    # state, against one 0.1 s poll and a signal.
    train = dict(TRAIN, epochs=4)
    spec = {
        "train": train,
        "paths": {
            **{k: str(v) for k, v in train_inputs.items()},
            "work_dir": str(tmp_path / "train_work"),
            "out_dir": str(tmp_path / "draft"),
        },
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_RUN, json.dumps(spec)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first_checkpoint = tmp_path / "train_work" / "checkpoints" / "0" / "training_state.json"
    give_up = time.monotonic() + 600  # only against a hang: the kill itself waits for the checkpoint
    try:
        while not first_checkpoint.exists():
            assert proc.poll() is None, "training ended before its first checkpoint"
            assert time.monotonic() < give_up, "no checkpoint within 600 s"
            time.sleep(0.1)
        # what SLURM or a person stopping the job sends: the stage stops the trainer (SIGTERM, which saves
        # `interrupted`), logs one line and exits 143
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the stage and the trainer it started
            proc.wait()
    assert proc.returncode == 143, stderr[-3000:]
    assert "stage train_draft stopped by SIGTERM; the rerun resumes from the last checkpoint" in stderr
    assert "FAILED" not in stderr, stderr[-3000:]
    assert (tmp_path / "train_work" / "checkpoints" / "interrupted").is_dir()  # saved, but not resumed from
    data = tmp_path / "train_work" / "data"
    mapping = {name: sha256(data / f"{name}-{TRAIN['draft_vocab_size']}.npy") for name in ("d2t", "t2d")}
    assert not (tmp_path / "draft").exists()

    summary = train_draft(
        train_settings(train),
        **train_inputs,
        work_dir=tmp_path / "train_work",
        out_dir=tmp_path / "draft",
        trust_remote_code=False,
        cpu_threads=2,
    )
    assert summary.resumed_from is not None and summary.resumed_from.epoch == 0
    assert summary.attempts == 2
    assert summary.vocab_mapping_sha256 == mapping  # reused, not rebuilt
    assert {name: sha256(data / f"{name}-{TRAIN['draft_vocab_size']}.npy") for name in mapping} == mapping
    second = (tmp_path / "train_work" / "logs" / "trainer-attempt-02.log").read_text()
    # the start of each message (Rich wraps the rest at the console's width)
    assert "Resuming training on epoch 1" in second
    assert "No previous training checkpoint found" not in second

    metrics = pd.read_csv(tmp_path / "draft" / "metrics.csv")
    steps = metrics[metrics["split"] == "train"]
    resumed_steps = steps[steps["attempt"] == 2]
    assert resumed_steps["global_step"].min() == summary.resumed_from.global_step > 0  # not from scratch
    assert resumed_steps["epoch"].min() == 1
    assert list(steps["global_step"]) == list(range(summary.steps))  # one row per step across both attempts
    # the kill can land before epoch 0's validation, which the resumed run does not repeat
    assert set(metrics[metrics["split"] == "val"]["epoch"]) >= {train["epochs"] - 1}


@pytest.mark.slow
def test_a_trainer_failure_quotes_its_traceback(train_inputs, tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    for item in train_inputs["files_dir"].iterdir():
        (files / item.name).symlink_to(item)
    (files / "hs_0.safetensors").unlink()
    (files / "hs_0.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(StageError) as failure:
        run_training({**train_inputs, "files_dir": files}, tmp_path, epochs=1)
    message = str(failure.value)
    assert "speculators train exited with code 1" in message
    assert "First traceback:\nTraceback (most recent call last):" in message
    assert "trainer-attempt-01.log" in message
    assert not (tmp_path / "draft").exists()


def test_a_trainer_stopped_by_a_signal_is_told_apart_from_a_crash():
    """A DataLoader worker's traceback made a SIGTERM read as 'speculators train exited with code 1'."""
    from eagle3_workflow.training.launcher import stop_signal

    assert stop_signal(-15, []) == "SIGTERM"
    assert stop_signal(143, []) == "SIGTERM"
    worker = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Terminated. "
    assert stop_signal(1, ["Traceback (most recent call last):", worker]) == "SIGTERM"
    assert stop_signal(1, ["Traceback (most recent call last):", "ValueError: bad ids"]) is None
