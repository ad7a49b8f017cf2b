"""train_draft for real: metric records through speculators' logger in a trainer-like process, and real CPU
training runs (a loadable draft, a kill and a resume, a failure's traceback). The pure parts (command building,
metrics parsing, the work directory): tests/unit/test_training.py.

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
from conftest import REPO, fill_up, kill_tree, train_settings, wait_until
from tiny_training import TRAIN, train_record

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.files.data_artefacts import ValidationReport
from eagle3_workflow.files.hidden_states import hs_file
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.files.writing import process_umask
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.checkpoint_size import FILES_OVERHEAD_BYTES
from eagle3_workflow.trainer.entry import FROZEN_LINE
from eagle3_workflow.training.checkpoint_space import checkpoint_needs
from eagle3_workflow.training.metrics import metrics_table, read_metric_lines
from eagle3_workflow.training.stage import train_draft

SCRIPTS = REPO / "workflow" / "scripts"
NUM_LAYERS = 8
LAYER_IDS = [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]  # EAGLE-3's capture for 8 layers


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
            save_file({"hidden_states": hidden, "token_ids": ids.contiguous()}, str(hs_file(files_dir, row)))
    hook.remove()
    return len(dataset), model.config.hidden_size


def gate_records(target: Path, rows: int, hidden_size: int) -> tuple[ApiCompatReport, ValidationReport]:
    """check_api's and validate_hidden_states's records for the hidden states write_hidden_states made."""
    from eagle3_workflow.reference.target_config import read_target_config

    api_compat = ApiCompatReport(
        passed=True, vllm_version="0.32.0", speculators_version="0.9.0", transformers_version="5",
        torch_version="2", device="cpu", layer_ids=LAYER_IDS, checks=[], target=read_target_config(target).info(),
    )  # fmt: skip
    validation = ValidationReport(
        passed=True, samples_expected=rows, samples_valid=rows, missing=[], bad={}, tokens=0, bytes=0,
        layer_count=len(LAYER_IDS), hidden_size=hidden_size, files_dir=[],
    )  # fmt: skip
    return api_compat, validation


@pytest.fixture(scope="module")
def train_inputs(tiny_targets, tmp_path_factory):
    """target, prepared/, token_freq.pt, hidden-state files, api_compat.json and validation.json."""
    return make_train_inputs(tiny_targets, tmp_path_factory.mktemp("train_inputs"))


def make_train_inputs(tiny_targets, root: Path) -> dict[str, Path]:
    """train_inputs' files in `root` (tests/integration/test_online_trainer.py builds its own)."""
    from conftest import TINY_DATA, preparation
    from transformers import AutoTokenizer

    from eagle3_workflow.prepare.conversations import prepare_conversations, write_prepared

    target = tiny_targets("llama", NUM_LAYERS)
    tokenizer = AutoTokenizer.from_pretrained(target)
    result = prepare_conversations([(TINY_DATA, "sharegpt")], tokenizer, preparation(max_seq_len=256, max_samples=24))
    write_prepared(result, root / "prepared", root / "token_freq.pt")
    rows, hidden_size = write_hidden_states(target, root / "prepared", root / "files", LAYER_IDS)
    write(root / "api_compat.json", gate_records(target, rows, hidden_size)[0])
    write(root / "validation.json", gate_records(target, rows, hidden_size)[1])
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
# Metrics: speculators' metric records, written by the trainer entry's handler

LOG = r"""
import json, logging, sys
from pathlib import Path
from speculators.train import cli
from speculators.train.logger import log_run_config, setup_root_logger
from eagle3_workflow.trainer.entry import install_metric_handler
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
    assert first["loss"] == pytest.approx(6.0)
    assert first["loss_1"] == pytest.approx(2.0)
    # the values themselves, not a console rendering rounded to 3 decimals
    assert first["full_acc_2"] == 0.1 * 3
    assert first["lr"] == 0.00075
    assert first["tokens_per_s"] == 1234.5
    assert first["error_records"] == 0.0
    assert frame.iloc[2]["loss"] == pytest.approx(4.5)
    assert frame.iloc[2]["full_acc_1"] == pytest.approx(0.2)


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


# speculators' real shutdown decorator and handler around a trainer whose save is only a second SIGTERM
SECOND_SIGTERM = r"""
import logging, os, signal, sys
from pathlib import Path
from eagle3_workflow.trainer.interrupt import apply_interrupt_patches
from speculators.train.graceful_shutdown import with_graceful_shutdown
if sys.argv[1] == "patched":
    apply_interrupt_patches()

class Resend(logging.Handler):
    sent = False

    def emit(self, record):  # speculators logs "Received SIGTERM" inside its handler's lock
        if sys.argv[2] == "resend" and not Resend.sent and record.getMessage().startswith("Received"):
            Resend.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # a re-send that arrives while that lock is held

logging.getLogger("speculators").addHandler(Resend())

class Trainer:
    class checkpointer:
        path = Path(".")

    @with_graceful_shutdown()
    def run_training(self):
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM's, to every process of the job
        raise AssertionError("not interrupted")

    def maybe_save_checkpoint(self, label):
        os.kill(os.getpid(), signal.SIGTERM)  # the stage's, passed on by its launcher while the save runs
        print("saved", label, flush=True)

Trainer().run_training()
"""


def test_a_second_sigterm_does_not_kill_the_interrupt_save():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    run = [sys.executable, "-c", SECOND_SIGTERM]
    unpatched = subprocess.run([*run, "unpatched", "-"], env=env, capture_output=True, text=True, timeout=120)
    assert unpatched.returncode == -signal.SIGTERM  # speculators alone: killed mid-save
    patched = subprocess.run([*run, "patched", "-"], env=env, capture_output=True, text=True, timeout=120)
    assert patched.returncode == 0, patched.stderr[-2000:]
    assert patched.stdout == "saved interrupted\n"
    # one more, inside speculators' handler (alone, it waits forever there for its own lock)
    resent = subprocess.run([*run, "patched", "resend"], env=env, capture_output=True, text=True, timeout=120)
    assert resent.returncode == 0, resent.stderr[-2000:]
    assert resent.stdout == "saved interrupted\n"


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
    assert list(train["global_step"]) == list(range(len(train)))
    assert len(train) == summary.steps
    assert set(metrics[metrics["split"] == "val"]["epoch"]) == {0, 1}
    assert {"loss_0", "full_acc_0", "full_acc_2", "cond_acc_2"} <= set(metrics.columns)
    assert train["loss"].iloc[-1] < train["loss"].iloc[0]  # it learned something

    model = Eagle3DraftModel.from_pretrained(str(draft))
    # the disk gate's estimate of a checkpoint (issue #41) against the two the trainer wrote: its tensors exact, the
    # small files (config, scheduler, zip records) within its overhead allowance
    [(_, need)] = checkpoint_needs(train_inputs["target"], tmp_path / "train_work" / "checkpoints", draft,
                                   settings=train_settings(TRAIN), captured_layers=len(LAYER_IDS) - 1)  # fmt: skip
    for epoch in (0, 1):
        written = sum(f.stat().st_size for f in (tmp_path / "train_work" / "checkpoints" / str(epoch)).iterdir())
        assert need.per_checkpoint - FILES_OVERHEAD_BYTES < written <= need.per_checkpoint, (epoch, written, need)
    # the published copy of the weights (same file system here: one need holds it), its tensors exact
    assert need.published < (draft / "model.safetensors").stat().st_size <= need.published + 64 * 1024
    d2t = np.load(tmp_path / "train_work" / "data" / f"d2t-{TRAIN['draft_vocab_size']}.npy")
    assert (model.d2t.cpu().numpy() == d2t).all()
    assert summary.resumed_from is None
    assert summary.attempts == 1
    # the CPU trainer froze its imported heap before training (trainer.entry.freeze_imported_heap)
    assert FROZEN_LINE in (tmp_path / "train_work" / "logs" / "trainer-attempt-01.log").read_text()

    again = run_training(train_inputs, tmp_path)  # a forced rerun: publishes the finished run, trains nothing
    assert again.attempts == 1
    assert again.final_checkpoint == summary.final_checkpoint
    assert sha256(draft / "model.safetensors") == sha256(
        tmp_path / "train_work" / "checkpoints" / "1" / "model.safetensors"
    )
    print(f"tiny CPU training: {summary.steps} steps, {elapsed:.1f} s (trainer wall {summary.wall_s} s)")


STAGE_RUN = r"""
import json, sys
from pathlib import Path
from eagle3_workflow.runtime.stage import run_stage
from eagle3_workflow.settings.sections import TrainSettings
from eagle3_workflow.settings.views import view_of, with_schema_defaults
from eagle3_workflow.training.stage import rerun_after_stop, train_draft
spec = json.loads(sys.argv[1])
paths = {k: Path(v) for k, v in spec["paths"].items()}
settings = view_of(TrainSettings, with_schema_defaults(train=spec["train"])["train"])
run_stage("train_draft", None, lambda log: train_draft(settings, **paths, trust_remote_code=False, cpu_threads=2),
          resumes=rerun_after_stop(paths["work_dir"], [settings.epochs]))
"""


def stopped_below(proc: subprocess.Popen) -> list[int]:
    """The pids of the stopped processes below the stage (SIGSTOP: the fault plugin's trainer)."""
    import psutil

    assert proc.poll() is None, f"the stage ended (exit {proc.returncode}) before its trainer stopped"
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    stopped = []
    for process in below:
        try:
            if process.status() == psutil.STATUS_STOPPED:
                stopped.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    return stopped


def stop_training_at(
    inputs: dict,
    tmp: Path,
    train: dict,
    *,
    optimizer_steps: int,
    stage_run: str = STAGE_RUN,
    config: dict | None = None,
) -> str:
    """Run the train_draft stage in its own process until its trainer has made ``optimizer_steps`` optimizer steps
    (the fault plugin then stops the trainer inside that step, after the optimizer step and before the step
    count), then SIGTERM the trainer and the stage as SLURM does at a time limit. The stage's stderr.
    ``stage_run``: the stage's script (spec["train"], spec["paths"] and spec["config"]: ``config``)."""
    spec = {
        "train": train,
        "config": config,
        "paths": {**{k: str(v) for k, v in inputs.items()}, "work_dir": str(tmp / "train_work"), "out_dir": str(tmp / "draft")},
    }  # fmt: skip
    pythonpath = [str(SCRIPTS), str(REPO / "tests" / "fault_plugins"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(pythonpath),
        "EAGLE3_FAULT": f"stop_after_optimizer_step:{optimizer_steps}",
    }
    stderr_path = tmp / "stage.stderr"
    with open(stderr_path, "w", encoding="utf-8") as stderr:  # a file: a full pipe would block the stage
        proc = subprocess.Popen(
            [sys.executable, "-c", stage_run, json.dumps(spec)],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            # a state, not a clock: the trainer stopped itself; 600 s only guards against a hang
            trainer: list[int] = []
            wait_until(
                lambda: trainer.extend(stopped_below(proc)) or trainer,
                600,
                f"the trainer to stop after optimizer step {optimizer_steps}",
            )
            # what SLURM does at a time limit: SIGTERM to every process of the job. The trainer's stays pending
            # while it is stopped, so it lands exactly where the trainer stopped. The stage stops its trainer
            # (one more SIGTERM, then SIGCONT), which saves `interrupted`; the stage logs one line and exits 143
            os.kill(trainer[0], signal.SIGTERM)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                kill_tree(proc)
    text = stderr_path.read_text(encoding="utf-8")
    assert proc.returncode == 143, text[-3000:]
    assert "FAILED" not in text, text[-3000:]
    return text


def saved_step_counts(folder: Path) -> tuple[int, set[float]]:
    """(the scheduler's steps, the optimizer's step count of every parameter) saved in a checkpoint folder."""
    import torch

    scheduler = torch.load(folder / "scheduler_state_dict.pt", weights_only=True)
    optimizer = torch.load(folder / "optimizer_state_dict.pt", weights_only=True)
    return scheduler["last_epoch"], {float(state["step"]) for state in optimizer["state"].values()}


def train_rows(tmp: Path) -> object:
    import pandas as pd

    metrics = pd.read_csv(tmp / "draft" / "metrics.csv")
    return metrics[metrics["split"] == "train"]


# The tiny training has 3 steps per epoch (18 training rows packed into total_seq_len 512).


@pytest.mark.slow
def test_sigterm_in_epoch_0_resumes_from_the_interrupt_save_at_its_step(train_inputs, tmp_path):
    """Issue 19: speculators saved checkpoints/interrupted during epoch 0, and the rerun started from scratch."""
    save = tmp_path / "train_work" / "checkpoints"
    stderr = stop_training_at(train_inputs, tmp_path, TRAIN, optimizer_steps=2)
    assert (
        f"stage train_draft stopped by SIGTERM; training was at epoch 0 step 2 (global step 2); speculators saved "
        f"{save}/interrupted; the rerun resumes from epoch 0 step 2 (global step 2)"
    ) in stderr
    assert not [p.name for p in save.iterdir() if p.name.isdigit()]  # no numbered checkpoint to fall back on
    state = json.loads((save / "interrupted" / "training_state.json").read_text())
    assert state == {"epoch": 0, "local_step": 2, "global_step": 2}
    # the signal came between the optimizer step and the step count; it was acted on at the end of the step, so
    # the saved weights, optimizer and scheduler are all those of step 2 (not one optimizer step ahead)
    assert saved_step_counts(save / "interrupted") == (2, {2.0})

    summary = run_training(train_inputs, tmp_path)
    assert (summary.resumed_from.epoch, summary.resumed_from.local_step, summary.resumed_from.global_step) == (0, 2, 2)
    assert summary.resumed_from.path == str(save / "0")
    assert summary.attempts == 2
    second = (tmp_path / "train_work" / "logs" / "trainer-attempt-02.log").read_text()
    # the start of each message (Rich wraps the rest at the console's width)
    assert "Resuming mid-epoch from epoch=0" in second
    assert "No previous training checkpoint found" not in second
    steps = train_rows(tmp_path)
    assert list(steps["global_step"]) == list(range(summary.steps))  # every step once, none trained twice
    assert list(steps["attempt"]) == [1, 1] + [2] * (summary.steps - 2)  # the rerun went on at step 2
    assert summary.steps == 2 * 3


@pytest.mark.slow
def test_sigterm_after_a_checkpoint_resumes_from_the_newer_interrupt_save_with_the_same_vocab_mapping(
    train_inputs, tmp_path
):
    """checkpoints/0 (end of epoch 0, global step 3) and interrupted/ (epoch 1 step 2, global step 5): the newer
    state wins by its recorded step, not by its folder's name."""
    save = tmp_path / "train_work" / "checkpoints"
    stderr = stop_training_at(train_inputs, tmp_path, TRAIN, optimizer_steps=5)
    assert (
        f"stage train_draft stopped by SIGTERM; training was at epoch 1 step 2 (global step 5); speculators saved "
        f"{save}/interrupted; the rerun resumes from epoch 1 step 2 (global step 5)"
    ) in stderr
    assert json.loads((save / "0" / "training_state.json").read_text())["global_step"] == 3
    data = tmp_path / "train_work" / "data"
    mapping = {name: sha256(data / f"{name}-{TRAIN['draft_vocab_size']}.npy") for name in ("d2t", "t2d")}
    assert not (tmp_path / "draft").exists()

    summary = run_training(train_inputs, tmp_path)
    assert (summary.resumed_from.epoch, summary.resumed_from.local_step, summary.resumed_from.global_step) == (1, 2, 5)
    assert summary.vocab_mapping_sha256 == mapping  # reused, not rebuilt
    assert {name: sha256(data / f"{name}-{TRAIN['draft_vocab_size']}.npy") for name in mapping} == mapping
    second = (tmp_path / "train_work" / "logs" / "trainer-attempt-02.log").read_text()
    assert "Resuming mid-epoch from epoch=1" in second
    steps = train_rows(tmp_path)
    assert list(steps["global_step"]) == list(range(summary.steps))
    assert list(steps["attempt"]) == [1] * 5 + [2] * (summary.steps - 5)


def test_train_draft_refuses_before_the_trainer_when_the_disk_cannot_hold_its_checkpoints(train_inputs, small_disk):
    """Issue #41: the H100's disk filled while writing epoch 1's checkpoint, after an epoch of training, and the
    trainer said only `basic_ios::clear: iostream error`. Here the work directory sits on a 24 MiB tmpfs another job
    has filled to ~1 MiB short: the 2 epochs' checkpoints (~2.9 MiB each with the estimate's files overhead) cannot
    fit, and train_draft refuses with the numbers before any trainer starts."""
    filler = small_disk / "other-job.bin"
    fill_up(filler)
    with open(filler, "r+b") as handle:  # leave ~1 MiB: the work directory's links and vocab mapping fit
        handle.truncate(filler.stat().st_size - (1 << 20))
    with pytest.raises(StageError) as refused:
        run_training(train_inputs, small_disk)
    message = str(refused.value)
    assert message.startswith("not enough disk for the trainer's checkpoints: 2 epoch folder(s) still to write")
    assert f"{small_disk} (the file system holding {small_disk / 'train_work' / 'checkpoints'}) has " in message
    assert "room for 0 checkpoint(s)." in message
    assert not list((small_disk / "train_work" / "logs").glob("trainer-attempt-*.log"))  # no trainer started
    assert not (small_disk / "draft").exists()


@pytest.mark.slow
def test_a_trainer_that_dies_on_a_disk_filled_during_training_says_disk_full(train_inputs, small_disk):
    """Issue #41's failure itself: the gate passed, then another job filled the disk while epoch 0 trained (here
    at the trainer's "Training epoch 1/1 started" line), and the trainer died writing the checkpoint. The stage's error
    starts with the cause, the free bytes now and the fix, then the trainer's traceback as before. Without the
    classification the error was the traceback alone."""
    filled = []

    def on_line(line: str) -> None:
        if "Training epoch 1/1 started" in line and not filled:
            filled.append(line)
            fill_up(small_disk / "other-job.bin")

    settings = train_settings({**TRAIN, "epochs": 1})
    with pytest.raises(StageError) as failure:
        train_draft(settings, **train_inputs, work_dir=small_disk / "train_work", out_dir=small_disk / "draft",
                    trust_remote_code=False, cpu_threads=2, on_line=on_line)  # fmt: skip
    message = str(failure.value)
    assert filled, message
    save_dir = small_disk / "train_work" / "checkpoints"
    # the first write to fail here is the trainer's metric log (train_work/logs, the same file system)
    assert message.startswith("disk full: the trainer died when a write failed: OSError: [Errno 28] "), message
    assert f"{small_disk} (the file system holding {save_dir}) has 0 B free now" in message
    assert "Fix: free space on" in message
    assert "speculators train exited with code 1." in message and "First traceback:" in message


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
