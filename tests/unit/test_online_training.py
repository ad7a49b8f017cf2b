"""train.hidden_states: online, the pure parts: which rows go to disk, how a job's GPUs are split, the trainer's
flags, the per-sample check and the failure policy (the real server and trainer: tests/integration/
test_online_trainer.py, tests/e2e/test_e2e.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from conftest import train_settings
from tiny_training import TRAIN

from eagle3_workflow.files.hidden_states import check_rows, check_sample, rows_on_disk
from eagle3_workflow.runtime.child import ProgressWatch
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.command import TRAINER_FIELDS_USED, TrainDevice, TrainPaths, build_train_command
from eagle3_workflow.trainer.online_spec import (
    OnlineSampleFailure,
    OnlineSpec,
    failed_rows,
    record_failure,
    samples_checked,
)
from eagle3_workflow.training.online import OnlineFolders, OnlineStalled, OnlineWatch, split_devices
from eagle3_workflow.training.stage import train_draft

# ---------------------------------------------------------------- the check set


def test_the_check_set_holds_the_longest_and_the_shortest_row_and_spreads_the_rest():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 11, 3]
    rows = check_rows(lengths, 4)
    assert len(rows) == 4 and rows == sorted(rows)
    assert 10 in rows and 1 in rows  # the longest (11 tokens) and the shortest (1)
    assert check_rows(lengths, 1) == [10]  # one row: the longest
    assert check_rows([3, 1], 8) == [0, 1]  # fewer rows than asked: all of them
    spread = check_rows(list(range(100)), 8)
    assert spread[0] == 0 and spread[-1] == 99 and len(spread) == 8
    assert max(b - a for a, b in zip(spread, spread[1:], strict=False)) <= 25


def test_offline_puts_every_row_on_disk_and_online_only_the_check_set():
    lengths = [4, 8, 2, 6, 5]
    assert rows_on_disk(lengths, None) == [0, 1, 2, 3, 4]
    assert rows_on_disk(lengths, 2) == [1, 2]


# ---------------------------------------------------------------- GPUs of the job


def test_the_server_takes_the_jobs_first_gpus_and_the_trainer_the_rest():
    assert split_devices(["4", "5", "6"], trainer_gpus=2, server_gpus=1) == (["4"], ["5", "6"])
    assert split_devices(["0", "1", "2", "3"], trainer_gpus=2, server_gpus=2) == (["0", "1"], ["2", "3"])
    # 0: one GPU shared (the server sized by train.online.gpu_memory_utilization)
    assert split_devices(["3"], trainer_gpus=1, server_gpus=0) == (["3"], ["3"])
    # a CPU trainer beside a GPU server
    assert split_devices(["2"], trainer_gpus=0, server_gpus=1) == (["2"], [])


def test_too_few_gpus_for_the_split_are_refused_with_the_fix():
    with pytest.raises(StageError, match=r"needs 3 GPU\(s\).*train.gpus=2.*server_gpus=1.*sees 2.*shares"):
        split_devices(["0", "1"], trainer_gpus=2, server_gpus=1)


# ---------------------------------------------------------------- the trainer's command


def test_online_training_asks_speculators_to_generate_each_sample_from_the_server(tmp_path):
    settings = train_settings({**TRAIN, "hidden_states": "online"})
    paths = TrainPaths.in_work_dir(tmp_path, tmp_path / "target", settings.draft_vocab_size)
    online = {"on_missing": "generate", "vllm_endpoint": "http://127.0.0.1:1234/v1", "request_timeout": 600,
              "generation_validation_retries": 2}  # fmt: skip
    command = build_train_command(settings, paths, TrainDevice("cpu"), target_layer_ids=[2, 4, 5],
                                  trust_remote_code=False, online=online)  # fmt: skip
    text = " ".join(command)
    assert "--on-missing generate" in text and "--on-missing raise" not in text
    assert "--vllm-endpoint http://127.0.0.1:1234/v1 --request-timeout 600 --generation-validation-retries 2" in text
    offline = " ".join(build_train_command(settings, paths, TrainDevice("cpu"), target_layer_ids=[2, 4, 5],
                                           trust_remote_code=False))  # fmt: skip
    assert "--on-missing raise" in offline and "--vllm-endpoint" not in offline
    # check_api verifies every field the stage sets exists in the installed speculators: the online ones too
    assert {"on_missing", "vllm_endpoint", "request_timeout", "generation_validation_retries"} <= set(
        TRAINER_FIELDS_USED
    )


def test_online_settings_without_a_server_are_refused_before_anything_starts(tmp_path):
    settings = train_settings({**TRAIN, "hidden_states": "online"})
    paths = {name: tmp_path / name for name in ("target", "prepared", "token_freq", "api_compat", "validation")}
    with pytest.raises(StageError, match="online but the stage was given no server"):
        train_draft(settings, **paths, files_dir=tmp_path / "f", work_dir=tmp_path / "w", out_dir=tmp_path / "d",
                    trust_remote_code=False)  # fmt: skip
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- each sample as it arrives


def sample(ids: list[int], layers: int = 4, hidden: int = 8, dtype: torch.dtype = torch.bfloat16) -> dict:
    torch.manual_seed(0)
    return {"hidden_states": torch.randn(len(ids), layers, hidden).to(dtype), "token_ids": torch.tensor(ids)}


def test_a_generated_sample_is_checked_for_shape_dtype_tokens_and_values():
    ids = [5, 6, 7]
    assert check_sample(sample(ids), ids, 4, 8, "bfloat16") is None
    assert "shape [3, 3, 8] != expected [3, 4, 8]" in check_sample(sample(ids, layers=3), ids, 4, 8, "bfloat16")
    assert "shape [3, 4, 16]" in check_sample(sample(ids, hidden=16), ids, 4, 8, "bfloat16")
    assert "dtype torch.float32 != the target's bfloat16" in check_sample(
        sample(ids, dtype=torch.float32), ids, 4, 8, "bfloat16"
    )
    assert check_sample(sample(ids), [5, 6, 9], 4, 8, "bfloat16") == "token_ids differ from the prepared input_ids"
    broken = sample(ids)
    broken["hidden_states"][1, 2, 3] = float("nan")
    assert check_sample(broken, ids, 4, 8, "bfloat16") == "hidden_states contain NaN or Inf"
    constant = {"hidden_states": torch.ones(3, 4, 8, dtype=torch.bfloat16), "token_ids": torch.tensor(ids)}
    assert check_sample(constant, ids, 4, 8, "bfloat16") == "hidden_states are constant (degenerate)"
    assert "keys" in check_sample({"hidden_states": broken["hidden_states"]}, ids, 4, 8, "bfloat16")


def spec(tmp_path: Path, max_failed: int) -> OnlineSpec:
    return OnlineSpec(layer_count=4, hidden_size=8, dtype="bfloat16", failures_path=str(tmp_path / "failed.jsonl"),
                      counts_dir=str(tmp_path / "counts"), max_failed_samples=max_failed, requests_in_flight=1)  # fmt: skip


def test_failed_samples_are_recorded_and_skipped_up_to_the_limit_then_fail_with_the_rows_and_the_fix(tmp_path):
    policy = spec(tmp_path, max_failed=2)
    record_failure(policy, 7, "Hidden-state round trip failed ... ConnectError")
    record_failure(policy, 7, "again, the next epoch")  # the same row counts once
    record_failure(policy, 3, "ValueError: the generated sample failed the workflow's check: NaN")
    assert failed_rows(tmp_path / "failed.jsonl") == {
        7: "again, the next epoch",
        3: "ValueError: the generated sample failed the workflow's check: NaN",
    }
    with pytest.raises(OnlineSampleFailure) as failure:
        record_failure(policy, 11, "timed out")
    message = str(failure.value)
    assert "failed for 3 sample(s)" in message and "max_failed_samples=2" in message
    assert "row 3:" in message and "row 7:" in message and "row 11: timed out" in message
    assert str(tmp_path / "failed.jsonl") in message and "Raise train.online.max_failed_samples" in message
    lines = (tmp_path / "failed.jsonl").read_text().splitlines()
    assert [json.loads(line)["row"] for line in lines] == [7, 7, 3, 11]


def test_a_row_given_as_a_numpy_integer_is_recorded(tmp_path):
    """speculators' batch sampler yields each batch's indices as a numpy array: the failed row arrives as numpy.int64,
    which json cannot write (the policy then ended training with a TypeError instead of skipping the sample)."""
    import numpy as np

    record_failure(spec(tmp_path, max_failed=1), np.int64(5), "timed out")
    assert failed_rows(tmp_path / "failed.jsonl") == {5: "timed out"}


def test_a_speculators_without_the_recovery_guard_the_concurrent_fetch_locks_is_refused(monkeypatch):
    """The concurrent fetch (train.online.requests_in_flight) serializes speculators' consecutive-failure count by
    overriding two of its guard's private methods: a speculators that renamed them is refused at the trainer's start,
    not left unguarded."""
    from speculators.train.recovery import GenerationRecoveryGuard

    from eagle3_workflow.trainer.online_samples import apply_online_patches

    monkeypatch.delattr(GenerationRecoveryGuard, "_record_success")
    with pytest.raises(RuntimeError, match=r"lack \['_record_success'\].*differs from 0.9.0"):
        apply_online_patches()


def test_no_failure_is_allowed_by_default(tmp_path):
    with pytest.raises(OnlineSampleFailure, match="failed for 1 sample"):
        record_failure(spec(tmp_path, max_failed=0), 0, "boom")


def test_the_checked_counts_of_every_trainer_process_add_up(tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    (counts / "checked-11-0.json").write_text(json.dumps({"samples": 3, "tokens": 120}))
    (counts / "checked-11-200.json").write_text(json.dumps({"samples": 2, "tokens": 30}))
    (counts / "checked-12-0.tmp").write_text("{")  # a write cut short is not a count
    assert samples_checked(counts) == (5, 150)
    assert samples_checked(tmp_path / "absent") == (0, 0)


def test_the_watch_keeps_the_high_water_mark_of_the_servers_files(tmp_path):
    folders = OnlineFolders(tmp_path)
    folders.storage.mkdir()
    watch = OnlineWatch(server=None, folders=folders)  # type: ignore[arg-type] - sample() reads the folder only
    (folders.storage / "a.safetensors").write_bytes(b"x" * 100)
    (folders.storage / "b.safetensors").write_bytes(b"x" * 50)
    (folders.storage / "b.safetensors.lock").write_bytes(b"")
    watch.sample()
    (folders.storage / "a.safetensors").unlink()
    watch.sample()
    assert (watch.peak_files, watch.peak_bytes) == (2, 150)


def test_samples_that_stop_arriving_fail_as_stalled_once_the_first_arrived_and_the_limit_adapts(tmp_path):
    folders = OnlineFolders(tmp_path)
    folders.counts.mkdir(parents=True)
    server = types.SimpleNamespace(tail=["INFO last line of the server"], log_path=tmp_path / "vllm_server.log")
    stall = ProgressWatch(floor_s=10.0, factor=20.0, setting="extraction.stall_timeout_s")
    watch = OnlineWatch(server=server, folders=folders, stall=stall)  # type: ignore[arg-type]

    def checked(samples: int) -> None:
        (folders.counts / "checked-7-0.json").write_text(json.dumps({"samples": samples, "tokens": samples * 10}))

    watch.watch_progress(0.0)
    watch.watch_progress(500.0)  # the trainer starting (compiling, spawning workers): not armed before a sample
    checked(1)
    watch.watch_progress(501.0)
    checked(2)
    watch.watch_progress(502.0)  # slowest interval 1 s: the limit is max(floor 10 s, 20 x 1 s) = 20 s
    watch.watch_progress(521.0)
    with pytest.raises(OnlineStalled) as stalled:
        watch.watch_progress(523.0)
    message = str(stalled.value)
    assert "no generated sample arrived for 21 s after 2 (limit 20 s: extraction.stall_timeout_s" in message
    assert "INFO last line of the server" in message and "vllm_server.log" in message
    checked(3)
    watch.watch_progress(524.0)  # an interval of 22 s (an epoch's checkpoint, say): 20 x 22 = 440 s from now on
    watch.watch_progress(900.0)


def test_the_report_and_the_model_card_say_where_the_hidden_states_came_from(tmp_path):
    from synthetic_run import training_summary

    from eagle3_workflow.files.draft_artefacts import OnlineTrainingStats

    offline = training_summary(tmp_path / "draft")
    assert offline.hidden_states_source() == "offline: files extracted to disk once, read every epoch"
    stats = OnlineTrainingStats(server_ready_s=19.5, samples_checked=768, tokens_checked=55182,
                                failed_samples={"7": "timed out"}, peak_files=1, peak_bytes=72440)  # fmt: skip
    republished = offline.model_copy(update={"hidden_states": "online"})  # a forced rerun started no trainer
    assert republished.hidden_states_source().endswith("(this launch started none)")
    online = offline.model_copy(update={"hidden_states": "online", "online": stats})
    assert online.hidden_states_source() == (
        "online: generated on demand by the trainer's own vLLM server, 768 samples (55182 tokens) checked as they "
        "arrived, 1 skipped after failing; at most 1 files on disk at once"
    )
