"""The tiny CPU training the training tests share (tests/unit/test_training.py,
tests/integration/test_training_trainer.py): its train.* settings, and a training-step metric record as
speculators logs it on `speculators.metrics` (an attempt entry: kind, payload, step)."""

from __future__ import annotations

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


def train_record(step: int, epoch: int, loss: float) -> list:
    train = {f"loss_{k}": loss / 3 for k in range(3)} | {f"full_acc_{k}": 0.1 * (k + 1) for k in range(3)}
    train |= {f"cond_acc_{k}": 0.5 for k in range(3)} | {"loss": loss, "error_records": 0.0}
    profile = {"fetch_ms": 12.5, "step_ms": 803.0, "tokens_per_s": 1234.5}
    record = {"train": train, "profile": profile, "epoch": epoch, "lr": 0.00075, "global_step": step}
    return ["metrics", record, step]
