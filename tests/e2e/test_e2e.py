"""The whole tiny pipeline, as `make demo` runs it, from an empty working directory: every artefact, the
report, a draft vLLM serves losslessly, and an honest learning check (trained beats untrained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import copied_run, rules_run, run_workflow, tiny_config, validated


@pytest.fixture
def tiny_run(tiny_pipeline):
    """The tiny pipeline (conftest's, shared with tests/e2e/test_reruns.py): run dir, wall seconds."""
    workdir, config, wall_s = tiny_pipeline
    return workdir / "results" / config["run"], wall_s


@pytest.mark.slow
def test_every_stage_leaves_its_artefact(tiny_run):
    run, _ = tiny_run
    for artefact in (
        "provenance.json",
        "data/manifest.json",
        "checks/api_compat.json",
        "checks/canary.json",
        "hidden_states/replica_0.json",
        "hidden_states/validation.json",
        "draft/config.json",
        "draft/model.safetensors",
        "draft/metrics.csv",
        "eval/acceptance.json",
        "report.html",
    ):
        assert (run / artefact).exists(), artefact
    for gate in ("checks/api_compat.json", "checks/canary.json", "hidden_states/validation.json"):
        assert json.loads((run / gate).read_text())["passed"] is True
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["packages"]["speculators"] == "0.9.0"
    assert provenance["config"]["run"] == "tiny"
    draft = json.loads((run / "draft" / "config.json").read_text())
    assert draft["speculators_model_type"] == "eagle3"
    html = (run / "report.html").read_text(errors="ignore")
    assert len(html) > 10_000


@pytest.mark.slow
def test_the_canary_passes_on_the_tiny_target_and_matches_hf(tiny_run):
    """The healthy llama case of tests/integration/test_gates_canary.py::test_canary_passes_and_matches_hf, read
    from the tiny pipeline's own canary (the rule, canary.num_samples prompts) instead of a server of its own:
    every slot nearest its own layer, within tolerance, against the fp32 reference; the slice is scratch. The
    full-depth check of the same run passes at every production id (the healthy side of the full-depth fault
    test there)."""
    run, _ = tiny_run
    canary = json.loads((run / "checks" / "canary.json").read_text())
    assert canary["passed"], canary["checks"]
    assert canary["proof"] == "hf_fp32" and canary["reference"].startswith("HF transformers")
    assert max(canary["per_layer_max_rel_error"].values()) < 0.05
    assert canary["canary_layer_ids"] == [2, 4, 6, 8]  # production's shape on the 8-layer tiny target
    assert set(canary["layer_matches"]) == {"2", "4", "6", "8"}
    assert all(match["best"] == k for k, match in canary["layer_matches"].items())
    assert not (run / "checks" / "canary_work" / "model").exists(), "the slice is scratch"
    assert not (run / "checks" / "canary_work" / "scratch").exists(), "the slice is scratch"
    full_depth = json.loads((run / "hidden_states" / "validation.json").read_text())["full_depth"]
    assert full_depth["passed"] and full_depth["layer_ids"] == [2, 4, 5, 8]
    assert all(slot["ok"] and slot["best"] == str(slot["claimed"]) for slot in full_depth["slots"])


@pytest.mark.slow
def test_trained_draft_beats_the_untrained_one_and_stays_lossless(tiny_run):
    run, _ = tiny_run
    acceptance = json.loads((run / "eval" / "acceptance.json").read_text())
    trained = acceptance["trained"]["mean_acceptance_length"]
    untrained = acceptance["untrained"]["mean_acceptance_length"]
    assert acceptance["lossless"] is True
    assert untrained >= 1.0
    assert trained >= 1.0
    # measured on this preset (seed 0): trained 1.30, untrained 1.00; the margin leaves room for CPU kernels
    assert trained > untrained + 0.1, (trained, untrained)
    assert acceptance["trained"]["per_position_acceptance"][0] > 0.1
    # the tiny preset times the trained draft only (evaluate.time_untrained false): the untrained one is measured
    # for acceptance and losslessness, not for tokens/s
    assert [t["concurrency"] for t in acceptance["trained"]["throughput"]] == [1, 8]
    assert acceptance["trained"]["tokens_per_s"] > 0
    assert acceptance["untrained"]["throughput"] == [] and acceptance["untrained"]["num_drafts"] > 0
    assert any(note.startswith("not timed (evaluate.time_untrained false): untrained") for note in acceptance["notes"])
    # the draft parity check ran by default: vLLM's draft proposed what the trainer's checkpoint predicts, step by step
    parity = acceptance["parity"]
    assert parity["verdict"] == "passed", parity
    assert parity["independent"] and parity["prompts"] == [0, 1, 2, 3]
    assert parity["steps_compared"] >= 100 and parity["proposals_compared"] >= parity["steps_compared"]
    assert parity["agreeing_steps"] + parity["ties_excused"] == parity["steps_compared"]


@pytest.mark.slow
def test_the_forecast_counts_the_trained_drafts_parameters_as_speculators_built_them(tiny_run):
    """The forecast's draft count (eagle3_workflow.forecast.shape) against the draft speculators' trainer saved:
    every weight matrix but the embedding (also SmolLM2-135M's draft: 9,805,824 both ways, 2026-12-06)."""
    from safetensors import safe_open

    from eagle3_workflow.forecast.shape import draft_params_per_token

    run, _ = tiny_run
    with safe_open(str(run / "draft" / "model.safetensors"), "pt") as weights:
        shapes = [weights.get_slice(name).get_shape() for name in weights.keys() if "embed" not in name]
    saved = sum(rows * cols for rows, cols in (s for s in shapes if len(s) == 2))
    draft = json.loads((run / "draft" / "config.json").read_text())
    target = json.loads((run / "target" / "config.json").read_text())
    assert draft_params_per_token(target, draft["draft_vocab_size"]) == saved > 0


@pytest.mark.slow
def test_a_second_run_does_nothing(tiny_run):
    run, _ = tiny_run
    proc = run_workflow(run.parent.parent, tiny_config(run="tiny"), extra=["-n"])
    assert "Nothing to be done" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_online_training_through_the_rules_keeps_a_handful_of_hidden_state_files(tiny_pipeline, tmp_path):
    """train.hidden_states: online through Snakemake, to the trained draft: the plan says so, extraction writes the
    check set only, and while the trainer runs the run folder never holds more than a handful of hidden-state
    files (sampled every 20 ms, the check set's files aside). It starts from a copy of the tiny pipeline less its
    hidden states and training: the switch reruns exactly extraction (the check set), validation and training;
    the data and the gates before them are the offline run's (they do not read train.hidden_states)."""
    import os
    import threading

    workdir, config, _ = tiny_pipeline
    run = Path("results") / config["run"]
    workdir = copied_run(workdir, tmp_path, without=(run / "hidden_states", run / "train_work", run / "draft"))
    config = {**config, "train": {**config["train"], "hidden_states": "online", "epochs": 1,
                                  "online": {"check_samples": 4}}}  # fmt: skip
    run = workdir / run
    storage = run / "train_work" / "online" / "hidden_states"
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            try:
                peak[0] = max(peak[0], sum(1 for e in os.scandir(storage) if e.name.endswith(".safetensors")))
            except OSError:
                continue

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        proc = run_workflow(workdir, config, targets=[str(run.relative_to(workdir) / "draft")])
    finally:
        done.set()
        watcher.join()
    assert rules_run(proc) == ["extract_hidden_states", "validate_hidden_states", "train_draft"]
    assert "hidden states: online (train.hidden_states)" in proc.stderr
    assert len(list((run / "hidden_states" / "files").glob("hs_*.safetensors"))) == 4  # the check set
    training = json.loads((run / "draft" / "training.json").read_text())
    assert training["hidden_states"] == "online"
    online = training["online"]
    rows = json.loads((run / "data" / "manifest.json").read_text())["records_kept"]
    assert online["samples_checked"] == rows and online["failed_samples"] == {}  # one epoch: each row once
    # at most one file per request in flight: train.num_workers is 0, so the trainer fetches alone
    in_flight = validated(config)["train"]["online"]["requests_in_flight"]
    assert 1 <= peak[0] <= in_flight and 1 <= online["peak_files"] <= in_flight
    assert not list(storage.glob("*.safetensors")), "every generated file was deleted once loaded"
    assert not (run / "train_work" / "data" / "hidden_states").exists(), "no hidden-state file is read from disk"
    command = " ".join(training["command"])
    assert "--on-missing generate" in command and "--vllm-endpoint http://127.0.0.1:" in command
    assert (run / "draft" / "model.safetensors").exists() and training["online"]["server_ready_s"] > 0
