"""train_draft's pure parts: command building, metrics parsing, the work directory. Metrics through speculators'
logger in a real process, and real CPU training runs: tests/integration/test_training_trainer.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import train_settings
from tiny_training import TRAIN, train_record

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.draft_artefacts import CheckpointInfo, TrainingFingerprint
from eagle3_workflow.runtime.child import first_traceback
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.command import (
    TRAINER_FIELDS_USED,
    TrainDevice,
    TrainPaths,
    build_train_command,
    resolve_device,
)
from eagle3_workflow.trainer.cpu_shim import SHIM_PATCH_POINTS, shim_patch_points_present, with_cpu_defaults
from eagle3_workflow.trainer.interrupt import interrupt_patch_points_present, interrupt_record
from eagle3_workflow.training.checkpoints import (
    FoundCheckpoint,
    latest_checkpoint,
    outlook_on_disk,
    plan_resume,
    prepare_resume,
    read_checkpoint,
    rerun_outlook,
)
from eagle3_workflow.training.launcher import trainer_env
from eagle3_workflow.training.metrics import metrics_table, read_metric_lines
from eagle3_workflow.training.workdir import reconcile_work_dir, stage_training_data

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
    assert command[:3] == ["py", "-m", "eagle3_workflow.trainer.entry"]
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
    assert single[:3] == ["py", "-m", "eagle3_workflow.trainer.entry"]
    assert "--draft-attn-impl" not in single
    assert "--loss-implementation" not in single  # flex + fused
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
        "eagle3_workflow.trainer.entry",
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
    assert flat["draft_vocab_size"] == 256
    assert flat["epochs"] == 2
    assert flat["lr"] == 0.003
    assert flat["checkpoint_freq"] == 0.5
    assert flat["train_data_ratio"] == 0.75
    assert flat["draft_attn_impl"] == "sdpa"
    assert flat["loss_implementation"] == "eager"
    assert flat["on_missing"] == "raise"
    assert flat["speculator_type"] == "eagle3"
    used = {a[2:].replace("-", "_") for a in command[3:] if a.startswith("--")}
    assert used <= set(TRAINER_FIELDS_USED) <= set(flat)


def test_device_follows_gpus_and_what_is_visible():
    assert resolve_device(0, 8, 1, 2) == TrainDevice("cpu", 1)
    assert resolve_device(8, 0, 1, 2) == TrainDevice("cpu", 1)
    assert resolve_device(4, 8, 1, 2) == TrainDevice("cuda", 4)
    with pytest.raises(StageError, match="only 2 CUDA"):
        resolve_device(8, 2, 1, 2)


def test_cpu_ranks_launch_the_gpu_paths_torchrun_command(monkeypatch):
    settings = train_settings({**TRAIN, "cpu_processes": 2})
    paths = TrainPaths.in_work_dir(Path("w"), Path("t"), 256)
    cpu = build_train_command(
        settings, paths, resolve_device(0, 0, 2, 2), target_layer_ids=[2], trust_remote_code=False
    )
    gpu = build_train_command(
        settings, paths, resolve_device(2, 2, 2, 2), target_layer_ids=[2], trust_remote_code=False
    )
    assert cpu[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                        "eagle3_workflow.trainer.entry", "--speculator-type"]  # fmt: skip
    # the same launcher and flags, plus the CPU's attention and loss implementations
    assert cpu[: len(gpu)] == gpu
    assert cpu[len(gpu) :] == ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    # the job's threads are shared among the ranks
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert trainer_env(TrainDevice("cpu", 2), 4)["OMP_NUM_THREADS"] == "2"
    assert trainer_env(TrainDevice("cpu", 1), 4)["OMP_NUM_THREADS"] == "4"


def test_more_cpu_ranks_than_cores_is_refused_with_the_fix():
    with pytest.raises(StageError) as refused:
        resolve_device(0, 0, 3, 2)
    assert "train.cpu_processes=3 but this job may run on 2 CPU core(s)" in str(refused.value)
    assert "Set train.cpu_processes to at most 2" in str(refused.value)
    assert resolve_device(0, 0, 2, 2) == TrainDevice("cpu", 2)
    assert resolve_device(1, 0, 2, 2) == TrainDevice("cpu", 2)  # no GPU visible: the CPU, with its ranks
    assert resolve_device(2, 2, 3, 2) == TrainDevice("cuda", 2)  # on GPUs the CPU ranks are not asked for


def test_shim_patch_points_exist_and_cpu_defaults_do_not_override():
    rows = shim_patch_points_present()
    assert [name for name, _, _ in rows] == [f"{m}:{a}" for m, a in SHIM_PATCH_POINTS]
    assert all(present for _, present, _ in rows), rows
    assert with_cpu_defaults(["--x", "1"])[-4:] == ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    assert with_cpu_defaults(["--draft-attn-impl=eager"]).count("--draft-attn-impl") == 0


def test_the_trainer_entry_applies_the_cpu_shim_only_on_cpu():
    from eagle3_workflow.trainer.entry import DEVICE_ENV, METRICS_ENV

    assert trainer_env(TrainDevice("cpu"), 2)[DEVICE_ENV] == "cpu"
    assert DEVICE_ENV not in trainer_env(TrainDevice("cuda", 1), 2)
    assert trainer_env(TrainDevice("cuda", 1), 2).get("COLUMNS") == os.environ.get("COLUMNS")  # no forced width
    assert METRICS_ENV not in trainer_env(TrainDevice("cpu"), 2)  # set per attempt by run_attempt


def test_a_cpu_trainer_waits_passively_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert trainer_env(TrainDevice("cpu"), 2)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in trainer_env(TrainDevice("cuda", 1), 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert trainer_env(TrainDevice("cpu"), 2)["OMP_WAIT_POLICY"] == "ACTIVE"


# ---------------------------------------------------------------------------------------------------------------
# Metrics: the trainer entry's handler and the table built from its records (speculators' real logger, in a
# trainer-like process: tests/integration/test_training_trainer.py)


def test_the_entry_refuses_a_speculators_whose_main_no_longer_sets_up_the_metric_logger(monkeypatch, tmp_path):
    import speculators.train.cli as cli

    from eagle3_workflow.trainer.entry import install_metric_handler

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


def made_from(lr: float) -> TrainingFingerprint:
    return TrainingFingerprint(
        settings={"lr": lr}, target_layer_ids=[2, 4, 5], target_config_sha256=None, target_weight_files={},
        prepared_sha256={}, token_freq_sha256="f", validation_sha256="v", hidden_state_samples_sha256={},
        speculators_version="0.9.0",
    )  # fmt: skip


def test_work_dir_is_kept_for_the_same_inputs_and_cleared_for_others(tmp_path):
    work = tmp_path / "train_work"
    assert reconcile_work_dir(work, made_from(lr=1)) is False
    (work / "checkpoints" / "0").mkdir(parents=True)
    assert reconcile_work_dir(work, made_from(lr=1)) is True
    assert (work / "checkpoints" / "0").is_dir()
    assert reconcile_work_dir(work, made_from(lr=2)) is False
    assert not (work / "checkpoints").exists()
    # a fingerprint that cannot be compared (cut short by a kill; or with an input this version does not know):
    # the checkpoints belong to unknown inputs, so they go too
    newer = made_from(lr=2).model_dump() | {"tokenizer_sha256": "t"}
    for marker in ('{"settings": {"lr"', json.dumps(newer)):
        (work / "checkpoints" / "0").mkdir(parents=True)
        (work / "fingerprint.json").write_text(marker)
        assert reconcile_work_dir(work, made_from(lr=2)) is False
        assert not (work / "checkpoints").exists()
        assert load(TrainingFingerprint, work / "fingerprint.json") == made_from(lr=2)


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


def fake_checkpoint(directory: Path, epoch: int, *, local_step: int = 0, global_step: int | None = None) -> None:
    """A checkpoint folder with speculators' files, training_state.json written last (None: a save cut short)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))
    torch.save({"state": {}}, directory / "optimizer_state_dict.pt")
    torch.save({"last_epoch": 0}, directory / "scheduler_state_dict.pt")
    if global_step is not None:
        state = {"epoch": epoch, "local_step": local_step, "global_step": global_step}
        (directory / "training_state.json").write_text(json.dumps(state))


def found(name: str, epoch: int, local_step: int, global_step: int) -> FoundCheckpoint:
    return FoundCheckpoint(name, CheckpointInfo(epoch=epoch, local_step=local_step, global_step=global_step, path=name))


def test_the_newest_state_is_chosen_by_its_recorded_step_not_by_its_folder():
    end_of_0 = found("0", 0, 0, 30)
    # interrupted in epoch 1 after 7 of its steps: newer than the end of epoch 0, moved to 1/ for speculators
    plan = plan_resume([end_of_0, found("interrupted", 1, 7, 37)])
    assert plan.newest.name == "interrupted"
    assert plan.promote_to == "1"
    assert plan.remove == ()
    # interrupted during epoch 0's validation: the same state as 0/, which is kept (no move needed)
    plan = plan_resume([end_of_0, found("interrupted", 0, 0, 30)])
    assert plan.newest is end_of_0
    assert plan.promote_to is None
    assert plan.remove == (("interrupted", "it is not newer than 0/ (global step 30 against 30)"),)
    # a mid-epoch checkpoint of epoch 1 (checkpoint_freq < 1) older than interrupted/: interrupted/ takes its place
    plan = plan_resume([end_of_0, found("1", 1, 5, 35), found("interrupted", 1, 7, 37)])
    assert (plan.newest.name, plan.promote_to) == ("interrupted", "1")
    assert plan.remove == (("1", "interrupted/ is newer (global step 35 against 37) and takes its place"),)


def test_incomplete_or_empty_states_are_never_resumed_from_and_say_why():
    cut = FoundCheckpoint("1", None, "no training_state.json: the save did not finish")
    plan = plan_resume([found("0", 0, 0, 30), cut, found("interrupted", -1, 0, 0)])
    assert plan.newest.name == "0"
    assert plan.remove == (
        ("1", "no training_state.json: the save did not finish"),
        ("interrupted", "it holds no trained step"),
    )
    # a complete folder numbered after the newest state but older (speculators takes the highest number)
    plan = plan_resume([found("2", 2, 0, 20), found("interrupted", 1, 4, 25)])
    assert plan.promote_to == "1"
    assert plan.remove[0][0] == "2"
    assert "numbered after it" in plan.remove[0][1]
    plan = plan_resume([cut, FoundCheckpoint("interrupted", None, "no model.safetensors")])
    assert plan.newest is None
    assert [name for name, _ in plan.remove] == ["1", "interrupted"]


def test_the_stop_sentence_says_what_the_rerun_does():
    interrupted = found("interrupted", 0, 37, 37)
    assert rerun_outlook([interrupted], epochs=2, label="ck") == (
        "training was at epoch 0 step 37 (global step 37); speculators saved ck/interrupted; the rerun resumes from "
        "epoch 0 step 37 (global step 37)"
    )
    assert rerun_outlook([], epochs=2, label="ck", last_logged=(0, 12)) == (
        "speculators saved no ck/interrupted; the rerun starts training from scratch"
    )
    cut = FoundCheckpoint("interrupted", None, "no training_state.json: the save did not finish")
    assert rerun_outlook([found("0", 0, 0, 30), cut], epochs=3, label="ck", last_logged=(1, 41)) == (
        "ck/interrupted is incomplete and is ignored (no training_state.json: the save did not finish); the rerun "
        "resumes from ck/0 at the start of epoch 1 (global step 30) (11 steps logged up to epoch 1 are trained again)"
    )
    assert rerun_outlook([found("0", 0, 0, 30), found("interrupted", 0, 0, 30)], epochs=3, label="ck") == (
        "speculators saved ck/interrupted at the end of epoch 0 (global step 30), no newer than ck/0; the rerun "
        "resumes from ck/0 at the start of epoch 1 (global step 30)"
    )
    assert rerun_outlook([found("1", 1, 0, 60)], epochs=2, label="ck") == (
        "speculators saved no ck/interrupted; all 2 epochs are trained: the rerun publishes ck/1 without training"
    )


def test_a_checkpoint_folder_is_complete_only_when_its_state_was_written_last(tmp_path):
    fake_checkpoint(tmp_path / "0", 0, global_step=3)
    assert read_checkpoint(tmp_path / "0").state.global_step == 3
    fake_checkpoint(tmp_path / "1", 1)  # killed before training_state.json
    assert read_checkpoint(tmp_path / "1").problem == "no training_state.json: the save did not finish"
    fake_checkpoint(tmp_path / "2", 2, global_step=9)
    (tmp_path / "2" / "model.safetensors").write_bytes(b"\x00" * 3)  # cut short (before its state was written)
    state_time = (tmp_path / "2" / "training_state.json").stat().st_mtime_ns
    os.utime(tmp_path / "2" / "model.safetensors", ns=(state_time - 10**9, state_time - 10**9))
    assert read_checkpoint(tmp_path / "2").problem.startswith("unreadable: SafetensorError(")
    # a later mid-epoch save into the same folder rewrote the optimizer, then was killed before its state
    fake_checkpoint(tmp_path / "3", 3, local_step=2, global_step=11)
    state_time = (tmp_path / "3" / "training_state.json").stat().st_mtime_ns
    os.utime(tmp_path / "3" / "optimizer_state_dict.pt", ns=(state_time + 10**9, state_time + 10**9))
    assert read_checkpoint(tmp_path / "3").problem == (
        "optimizer_state_dict.pt is newer than training_state.json: a later save into this folder did not finish"
    )
    fake_checkpoint(tmp_path / "4", 5, global_step=12)
    assert read_checkpoint(tmp_path / "4").problem == "its training_state.json records epoch 5, not 4"
    fake_checkpoint(tmp_path / "5", 5, global_step=13)
    (tmp_path / "5" / "training_state.json").write_text('{"epoch": 5')
    assert read_checkpoint(tmp_path / "5").problem.startswith("training_state.json is unreadable: JSONDecodeError(")


def test_prepare_resume_moves_the_newest_interrupt_save_into_place_and_drops_half_written_ones(tmp_path, caplog):
    save = tmp_path / "checkpoints"
    fake_checkpoint(save / "0", 0, global_step=3)
    fake_checkpoint(save / "1", 1)  # the end-of-epoch save of epoch 1, cut short by the stop
    fake_checkpoint(save / "interrupted", 1, local_step=3, global_step=6)  # saved after it
    (save / "epoch0_end").symlink_to("0")
    (save / "epoch1_step1").symlink_to("1")
    logs = tmp_path / "logs"
    logs.mkdir()
    record = {"train": {"loss": 1.0}, "epoch": 1, "global_step": 5}
    (logs / "metrics-attempt-01.jsonl").write_text(json.dumps({"step": 5, "metrics": record}) + "\n")
    assert outlook_on_disk(save, logs, 3) == (
        f"training was at epoch 1 step 3 (global step 6); speculators saved {save}/interrupted; the rerun resumes "
        "from epoch 1 step 3 (global step 6)"
    )
    with caplog.at_level("INFO", logger="eagle3.training"):
        state = prepare_resume(save)
    assert state == CheckpointInfo(epoch=1, local_step=3, global_step=6, path=str(save / "1"))
    assert "ignoring checkpoint" in caplog.text and "no training_state.json: the save did not finish" in caplog.text
    assert sorted(p.name for p in save.iterdir()) == ["0", "1", "epoch0_end", "epoch1_step3"]
    assert os.readlink(save / "epoch1_step3") == "1"
    assert latest_checkpoint(save) == state  # what speculators resumes from: the highest number
    assert prepare_resume(save) == state  # nothing left to move
    assert prepare_resume(tmp_path / "nothing") is None


def test_the_interrupt_record_is_speculators_training_state_for_where_the_trainer_is():
    assert interrupt_record(0, 37, 37, epoch_done=False) == {"epoch": 0, "local_step": 37, "global_step": 37}
    assert interrupt_record(1, 4, 34, epoch_done=False) == {"epoch": 1, "local_step": 4, "global_step": 34}
    # nothing trained in epoch 2 yet: the end of epoch 1; epoch 1 trained and being validated: its end
    assert interrupt_record(2, 0, 60, epoch_done=False) == {"epoch": 1, "local_step": 0, "global_step": 60}
    assert interrupt_record(1, 30, 60, epoch_done=True) == {"epoch": 1, "local_step": 0, "global_step": 60}
    assert interrupt_record(0, 0, 0, epoch_done=False)["global_step"] == 0  # nothing to resume


def test_interrupt_patch_points_exist():
    rows = interrupt_patch_points_present()
    assert all(present for _, present, _ in rows), rows
    assert (
        "step_callback"
        in dict((name, detail) for name, _, detail in rows)["speculators.train.trainer:Trainer.train_epoch"]
    )


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


def test_a_trainer_stopped_by_a_signal_is_told_apart_from_a_crash():
    """A DataLoader worker's traceback made a SIGTERM read as 'speculators train exited with code 1'."""
    from eagle3_workflow.training.launcher import stop_signal

    assert stop_signal(-15, []) == "SIGTERM"
    assert stop_signal(143, []) == "SIGTERM"
    worker = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Terminated. "
    assert stop_signal(1, ["Traceback (most recent call last):", worker]) == "SIGTERM"
    assert stop_signal(1, ["Traceback (most recent call last):", "ValueError: bad ids"]) is None


def test_the_vocab_mapping_is_speculators_own_code_loaded_without_its_package():
    """train_draft builds d2t/t2d with speculators' function; loading that one module skips the package's
    __init__ (the trainer, the models: ~5 s of imports on 2 cores), and the mapping equals the package import's."""
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from eagle3_workflow.training.workdir import vocab_mapping_module\n"
        "module = vocab_mapping_module()\n"
        "assert vocab_mapping_module() is module\n"
        "assert not [m for m in sys.modules if m == 'speculators' or m.startswith('speculators.')], 'package imported'\n"
        "d2t, t2d = module.build_vocab_mappings_from_distribution({5: 9, 2: 4, 7: 1}, 2, 10)\n"
        "import speculators.train.vocab_mapping as packaged\n"
        "assert module.build_vocab_mappings_from_distribution.__code__.co_filename == packaged.__file__\n"
        "d2t_p, t2d_p = packaged.build_vocab_mappings_from_distribution({5: 9, 2: 4, 7: 1}, 2, 10)\n"
        "assert torch.equal(d2t, d2t_p) and torch.equal(t2d, t2d_p)\n"
        "print(d2t.tolist(), t2d.nonzero().flatten().tolist())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "workflow" / "scripts")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[0] == "[2, 4] [2, 5]"  # the two most frequent tokens (2, 5), d2t as offsets
