"""The trainer's checkpoints and the disk (issue #41): the estimate of one checkpoint against real ones, which epochs
speculators saves, the refusal before training, and the failure's cause when the trainer dies writing one.
train_draft's own refusal on a small file system: tests/integration/test_training_trainer.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_workflow.files.disk import FileSystemSpace, mount_point, space_of
from eagle3_workflow.trainer.checkpoint_size import (
    FILES_OVERHEAD_BYTES,
    checkpoint_bytes,
    draft_model_bytes,
    draft_tensors,
    folders_to_write,
    saved_epochs,
)
from eagle3_workflow.training.checkpoint_space import (
    CheckpointNeed,
    checkpoint_needs,
    checkpoint_write_failure,
    space_refusal,
    write_failure_sentence,
)
from eagle3_workflow.training.launcher import trainer_failure

# the Kimi stand-in preset's tiny target (config/presets/kimi-k25-stand-in.yaml), its text section
TINY = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 256, "vocab_size": 1025}  # fmt: skip
# the Kimi-K2.5 stand-in at real width (issue #41's run: results/kimi-k25-real-width/target/config.json): MLA, so
# transformers' config resolves head_dim to qk_rope_head_dim (64), and the draft speculators built had head_dim 64
KIMI_REAL_WIDTH = {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": None,
                   "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                   "intermediate_size": 18432, "vocab_size": 163840}  # fmt: skip


def test_one_checkpoint_is_the_bf16_draft_and_two_bf16_adamw_moments():
    """Exact against a checkpoint speculators' CPU trainer wrote for the Kimi stand-in preset (2026-12-06,
    /tmp/kimi-demo, draft vocab 512, ids 2 4 5): model.safetensors held 924,673 bytes of tensors (its header says so:
    the 1025 x 128 embedding, lm_head 512 x 128, fc, one layer, the norms in bf16, t2d and d2t) and
    optimizer_state_dict.pt 13 parameters' exp_avg and exp_avg_sq in bf16 (263,040 elements each) and a bf16 step."""
    tensors = draft_tensors(TINY, draft_layers=1, draft_vocab_size=512, captured_layers=3)
    assert tensors.frozen == 1025 * 128 + 512 * 128  # embedding + lm_head: saved, never trained
    assert tensors.trained_matrices + tensors.trained_vectors == 263_040
    assert tensors.parameters_with_state == 13
    model = 2 * (tensors.frozen + tensors.trained_matrices + tensors.trained_vectors) + tensors.buffer_bytes
    assert model == 924_673
    assert checkpoint_bytes(tensors, "adamw") - FILES_OVERHEAD_BYTES == 924_673 + 263_040 * 4 + 13 * 2
    # Muon keeps one momentum buffer per matrix: less, never more
    assert checkpoint_bytes(tensors, "muon") == checkpoint_bytes(tensors, "adamw") - 2 * tensors.trained_matrices


def test_the_real_width_draft_is_what_the_h100_wrote():
    """Issue #41, third lease (H100, 2026-12-06): each saved epoch's folder held model.safetensors of 3,868,466,880
    bytes and optimizer_state_dict.pt of 3,024,306,871 (6,892,782,659 with the small files, du). The draft's
    attention is 64 heads of head_dim 64 (its config.json): the rope part of MLA's head, as transformers' DeepseekV3
    config resolves it. Sizing it at hidden / heads = 112 instead put the estimate 13% above."""
    tensors = draft_tensors(KIMI_REAL_WIDTH, draft_layers=1, draft_vocab_size=512, captured_layers=3)
    model = 2 * (tensors.frozen + tensors.trained_matrices + tensors.trained_vectors) + tensors.buffer_bytes
    assert 0 < 3_868_466_880 - model < 64 * 1024  # the safetensors header beside the tensors
    state = checkpoint_bytes(tensors, "adamw") - FILES_OVERHEAD_BYTES - model
    assert 0 < 3_024_306_871 - state < 64 * 1024  # torch.save's zip records beside the bf16 moments
    one = checkpoint_bytes(tensors, "adamw")
    assert 6_892_782_659 <= one <= 6_892_782_659 + FILES_OVERHEAD_BYTES
    free = 63 * 2**30 - 54_219_872_086 - 527_722_048  # before the target, minus the target and hidden states
    need = CheckpointNeed(folders_to_write(2, 1.0, set()), one)
    refusal = space_refusal(need, FileSystemSpace(Path("/"), free, 80 * 10**9), save_dir=Path("ck"), margin=1.1)
    assert refusal is not None and "room for 1 checkpoint(s)." in refusal


def test_train_drafts_whole_write_is_the_checkpoints_and_the_published_draft():
    """The third lease's train_draft wrote 13,785,567,047 bytes of checkpoints (2 epochs, du) and published
    draft/model.safetensors of 3,868,466,880: the need of one file system holding both, to within the files' headers
    and small files."""
    tensors = draft_tensors(KIMI_REAL_WIDTH, draft_layers=1, draft_vocab_size=512, captured_layers=3)
    need = CheckpointNeed(
        folders_to_write(2, 1.0, set()), checkpoint_bytes(tensors, "adamw"), draft_model_bytes(tensors)
    )
    assert 0 < need.total - (13_785_567_047 + 3_868_466_880) < 2 * FILES_OVERHEAD_BYTES
    # room for both checkpoints but not the published copy: refused, and the message says what the rest is
    free = int(1.1 * 2 * need.per_checkpoint) + 10**6
    refusal = space_refusal(need, FileSystemSpace(Path("/"), free, 10**12), save_dir=Path("ck"), margin=1.1)
    assert refusal is not None and "+ the published draft's weights 3.60 GiB (3868465152 bytes)" in refusal
    assert "room for 1 checkpoint(s)." in refusal
    # the published copy alone, on its own file system
    alone = CheckpointNeed([], need.per_checkpoint, need.published)
    assert space_refusal(alone, FileSystemSpace(Path("/d"), 43 * 10**8, 10**12), save_dir=Path("d"), margin=1.1) is None
    message = space_refusal(alone, FileSystemSpace(Path("/d"), 43 * 10**8, 10**12), save_dir=Path("d"), margin=1.2)
    assert message is not None and message.startswith(
        "not enough disk for the published draft (draft/model.safetensors"
    )
    assert "room for" not in message


def test_the_needs_are_per_file_system(tmp_path, monkeypatch):
    from eagle3_workflow.training import checkpoint_space

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    settings = SimpleNamespace(draft_layers=1, draft_vocab_size=512, epochs=2, checkpoint_freq=1.0, optimizer="adamw")
    needs = checkpoint_needs(target, tmp_path / "ck", tmp_path / "draft", settings=settings, captured_layers=3)
    assert [(folder.name, need.folders, need.published > 0) for folder, need in needs] == [("ck", [0, 1], True)]
    monkeypatch.setattr(checkpoint_space, "same_file_system", lambda a, b: False)
    needs = checkpoint_needs(target, tmp_path / "ck", tmp_path / "draft", settings=settings, captured_layers=3)
    assert [(folder.name, need.folders, need.published) for folder, need in needs] == [
        ("ck", [0, 1], 0),
        ("draft", [], needs[0][1].per_checkpoint - 263_040 * 4 - 13 * 2 - FILES_OVERHEAD_BYTES),
    ]


def test_later_layers_read_the_hidden_state_alone():
    one = draft_tensors(TINY, draft_layers=1, draft_vocab_size=512, captured_layers=3)
    two = draft_tensors(TINY, draft_layers=2, draft_vocab_size=512, captured_layers=3)
    # q, k, v from 128 wide (not [embedding; hidden]), o, the MLP, two norms (no hidden_norm)
    assert two.trained_matrices - one.trained_matrices == 128 * (128 + 2 * 128) + 128 * 128 + 3 * 128 * 256
    assert two.trained_vectors - one.trained_vectors == 2 * 128
    assert two.parameters_with_state - one.parameters_with_state == 9


def test_saved_epochs_follow_speculators_rule_and_folders_on_disk_are_rewritten_in_place():
    assert saved_epochs(3, 1.0) == [0, 1, 2]
    assert saved_epochs(3, 0.25) == [0, 1, 2]  # mid-epoch saves rewrite the epoch's folder
    assert saved_epochs(6, 2) == [0, 1, 3, 5]  # epoch 0, then (e + 1) % 2 == 0
    assert folders_to_write(3, 1.0, {"0", "interrupted", "epoch0_end"}) == [1, 2]
    assert folders_to_write(2, 1.0, {"0", "1"}) == []


def test_the_refusal_names_bytes_needed_free_the_file_system_and_the_fixes(tmp_path):
    need = CheckpointNeed([1, 2], 10**9)
    space = FileSystemSpace(Path("/mnt/small"), 2 * 10**9, 50 * 10**9)
    message = space_refusal(need, space, save_dir=tmp_path / "checkpoints", margin=1.1)
    assert message is not None
    assert message.startswith("not enough disk for the trainer's checkpoints: 2 epoch folder(s) still to write")
    assert "(2000000000 bytes; x1.1 margin = 2.05 GiB)" in message
    assert f"/mnt/small (the file system holding {tmp_path / 'checkpoints'}) has 1.86 GiB free (2000000000 bytes" in (
        message
    )
    assert "room for 1 checkpoint(s)." in message
    for fix in ("free space", "larger disk", "train.checkpoint_freq", "train.epochs", "train.disk_margin"):
        assert fix in message
    assert space_refusal(need, FileSystemSpace(Path("/"), 23 * 10**8, 1), save_dir=tmp_path, margin=1.1) is None
    assert space_refusal(CheckpointNeed([], 10**12), space, save_dir=tmp_path, margin=1.1) is None


# issue #41's trainer output, as the stage quoted it (train_draft.log on the H100)
H100_LINES = [
    "Writing model shards: 100%|██████████| 1/1 [00:03<00:00,  3.21s/it]",
    "Traceback (most recent call last):",
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/serialization.py", line 1004, in save',
    "    _save(",
    '  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/serialization.py", line 1313, in _save',
    "    zip_file.write_record(name, storage, num_bytes)",
    "RuntimeError: basic_ios::clear: iostream error",
    "",
    "During handling of the above exception, another exception occurred:",
    "",
    "Traceback (most recent call last):",
    '  File "/tmp/site/speculators/train/checkpointer.py", line 359, in save_checkpoint',
    "    torch.save(payload, self.optimizer_path(epoch))",
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 851448960 vs 851448850",
]


def test_a_write_failure_is_found_in_the_trainers_output():
    assert checkpoint_write_failure(H100_LINES) == "RuntimeError: basic_ios::clear: iostream error"
    assert checkpoint_write_failure(["OSError: [Errno 28] No space left on device: 'x'"]) is not None
    assert checkpoint_write_failure(["safetensors_rust.SafetensorError: I/O error: Disk quota exceeded"]) is not None
    other = ["Traceback (most recent call last):", "RuntimeError: CUDA out of memory", "ValueError: bad header"]
    assert checkpoint_write_failure(other) is None


def test_a_trainer_that_died_writing_says_disk_full_with_the_free_bytes_and_the_fix(tmp_path):
    attempt_log = tmp_path / "train_work" / "logs" / "trainer-attempt-01.log"
    attempt_log.parent.mkdir(parents=True)
    larger_than_free = space_of(tmp_path).total + 1  # more than is free whatever other jobs do meanwhile
    message = str(trainer_failure(1, ["python", "-m", "x"], H100_LINES, attempt_log, checkpoint_bytes=larger_than_free))
    save_dir = tmp_path / "train_work" / "checkpoints"
    assert message.startswith("disk full: the trainer died when a write failed: RuntimeError: basic_ios::clear: ")
    assert f"{mount_point(tmp_path)} (the file system holding {save_dir}) has " in message
    assert "bytes, of " in message and "one checkpoint of this draft takes about" in message
    assert "Fix: free space on" in message and "it resumes from the newest complete checkpoint" in message
    # today's account follows: how it ended and the first traceback
    assert "speculators train exited with code 1.\ncommand: python -m x\n" in message
    assert "First traceback:" in message

    roomy = str(trainer_failure(1, ["x"], H100_LINES, attempt_log, checkpoint_bytes=1))
    assert roomy.startswith("the trainer died when a write failed (a full disk at that moment, since freed")
    plain = str(trainer_failure(1, ["x"], ["Traceback (most recent call last):", "ValueError: x"], attempt_log))
    assert plain.startswith("speculators train exited with code 1.")


def test_write_failure_sentence_trusts_an_explicit_enospc_whatever_is_free_now(tmp_path):
    space = FileSystemSpace(tmp_path, 10**12, 10**13)
    line = "OSError: [Errno 28] No space left on device"
    assert write_failure_sentence(line, space, save_dir=tmp_path, per_checkpoint=10**9).startswith("disk full: ")
    assert write_failure_sentence(line, space, save_dir=tmp_path, per_checkpoint=None).startswith("disk full: ")


@pytest.mark.parametrize("missing", ["hidden_size", "vocab_size"])
def test_a_config_without_the_draft_shape_is_refused_with_what_is_missing(missing):
    from eagle3_workflow.settings.errors import StageError

    with pytest.raises(StageError, match=missing):
        draft_tensors({k: v for k, v in TINY.items() if k != missing}, draft_layers=1, draft_vocab_size=8,
                      captured_layers=3)  # fmt: skip
