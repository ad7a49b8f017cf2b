"""The draft parity check (evaluation/parity.py) for real: the tiny pipeline's trained draft, served by vLLM (CPU)
as it is and with one fault injected into a copy of the served draft/ each (its config.json or d2t: the four of
issue 46, and the aux layer ids one deeper), against the trained draft's prediction (speculators' model from the
trainer's checkpoint, the fp32 reference's hidden states). The healthy draft agrees step by step; each fault fails,
naming the key it changed. One measurement process, one engine per draft, the first 4 heldout prompts, 48 tokens
each (as the tiny preset's evaluate_draft). The stage's own run of the check (default on): tests/e2e/test_e2e.py
(acceptance.json's parity)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import evaluation, shift_d2t, tiny_settings

from eagle3_workflow.evaluation.launch import (
    measurement_engine_kwargs,
    measurement_environment,
    run_measurement_process,
)
from eagle3_workflow.evaluation.parity import Served, check_parity, parity_failure
from eagle3_workflow.evaluation.prompts import load_prompts
from eagle3_workflow.evaluation.protocol import MeasurementSpec, eagle3_run
from eagle3_workflow.settings.stages import ServingStage

PROMPTS, MAX_TOKENS, K = 4, 48, 3  # the tiny preset's parity pass: its default 4 prompts, its max_tokens


def edit_config(draft: Path, change) -> None:
    config = json.loads((draft / "config.json").read_text())
    change(config)
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def shift_draft_d2t(draft: Path) -> None:
    """Each draft id names its neighbour's target token (conftest.shift_d2t on the draft's weights)."""
    shift_d2t(draft / "model.safetensors")


def _flip_norm(config):
    config["norm_before_residual"] = not config["norm_before_residual"]


def _cut_positions(config):
    config["transformer_layer_config"]["max_position_embeddings"] = 16


def _deeper_layers(config):
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]


def _other_rope_theta(config):
    layer = config["transformer_layer_config"]
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        rope["rope_theta"] = rope["rope_theta"] * 100
    else:
        layer["rope_theta"] = layer.get("rope_theta", 10000.0) * 100


# fault -> (how it is injected into the served copy, what the failure must name, whether vLLM's proposals move
# beyond a near-tie on the tiny draft: a rope_theta 100x larger moves its logits by at most 5.5 standard deviations
# of the rounding model (parity.py), so only the comparison of the served files with the checkpoint sees it there)
FAULTS = {
    "norm_before_residual": (lambda d: edit_config(d, _flip_norm), "norm_before_residual: served", True),
    "d2t": (shift_draft_d2t, "vocabulary mapping d2t", True),
    "max_position_embeddings": (lambda d: edit_config(d, _cut_positions),
                                "transformer_layer_config.max_position_embeddings: served 16", True),
    "rope_theta": (lambda d: edit_config(d, _other_rope_theta), "transformer_layer_config.rope_parameters: served",
                   False),
    # the case that passed every earlier gate: vLLM hands the draft the layers one deeper
    "aux_layer_ids": (lambda d: edit_config(d, _deeper_layers), "eagle_aux_hidden_state_layer_ids: served [3, 5, 6]",
                      True),
}  # fmt: skip


def served_parity(run_dir: Path, drafts: dict[str, Path], work_dir: Path) -> dict:
    """Serve each draft (one engine each, one process) on the run's first heldout prompts and judge its parity
    against the run's trained draft. Run from the pipeline's working directory (training.json's checkpoint path
    is relative to it). Returns label -> (DraftParity, seconds of the check)."""
    from transformers import AutoTokenizer

    target = run_dir / "target"
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    settings = evaluation(prompts="heldout", num_prompts=PROMPTS, max_tokens=MAX_TOKENS)
    prompt_set = load_prompts(settings, tokenizer, prepared_dir=run_dir / "data" / "prepared", train_data_ratio=0.9,
                              max_model_len=512)  # fmt: skip
    vllm = tiny_settings(ServingStage).vllm
    engine = measurement_engine_kwargs(vllm, target=str(target.resolve()), dtype="bfloat16", trust_remote_code=False,
                                       seed=0, device="cpu", tensor_parallel_size=1, in_process=True)  # fmt: skip
    runs = [eagle3_run(label, draft, K).model_copy(update={"lossless_pass": False, "timing_pass": False,
                                                           "parity_prompts": PROMPTS})
            for label, draft in drafts.items()]  # fmt: skip
    spec = MeasurementSpec(engine=engine, prompts=[p.token_ids for p in prompt_set.prompts], max_tokens=MAX_TOKENS,
                           timing_repeats=1, runs=runs, stop_token_ids=[tokenizer.eos_token_id])  # fmt: skip
    env = measurement_environment(device="cpu", cpu_threads=2, in_process=True)
    result, _ = run_measurement_process(spec, work_dir, "parity", env=env, log_path=work_dir / "log", timeout_s=600)
    out = {}
    for label, run in zip(drafts, result.runs, strict=True):
        served = [Served(prompt=p.token_ids, output=o, steps=s, proposals=q)
                  for p, o, s, q in zip(prompt_set.prompts, run.parity_outputs, run.parity_steps, run.parity_proposals,
                                        strict=True)]  # fmt: skip
        started = time.monotonic()
        parity = check_parity(served, prompt_indices=list(range(PROMPTS)), draft=drafts[label], target=target, k=K,
                              dtype="bfloat16", trust_remote_code=False, decode=tokenizer.decode,
                              reference_device="cpu")  # fmt: skip
        out[label] = (parity, time.monotonic() - started)
    return out


@contextlib.contextmanager
def working_directory(path: Path):
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@pytest.mark.slow
def test_the_served_draft_agrees_with_the_trained_one_and_each_injected_fault_fails(tiny_pipeline, tmp_path):
    workdir, config, _ = tiny_pipeline
    run_dir = workdir / "results" / config["run"]
    drafts = {"healthy": run_dir / "draft"}
    for fault, (inject, _, _) in FAULTS.items():
        drafts[fault] = Path(shutil.copytree(run_dir / "draft", tmp_path / fault))
        inject(drafts[fault])
    with working_directory(workdir):
        results = served_parity(run_dir, drafts, tmp_path)
    for label, (parity, seconds) in results.items():
        print(f"{label}: {parity.verdict}, {parity.agreeing_steps}/{parity.steps_compared} agree, "
              f"{parity.ties_excused} ties, {parity.differing_steps} differ ({seconds:.1f} s)", file=sys.stderr)  # fmt: skip

    healthy, _ = results["healthy"]
    assert healthy.verdict == "passed", parity_failure(healthy, draft="healthy")
    assert healthy.independent and "trainer's final checkpoint" in healthy.reference
    assert healthy.steps_compared >= 20 and healthy.agreeing_steps + healthy.ties_excused == healthy.steps_compared
    assert healthy.prompts == list(range(PROMPTS))
    for fault, (_, names, moves_steps) in FAULTS.items():
        parity, _ = results[fault]
        message = parity_failure(parity, draft=fault)
        print(message, file=sys.stderr)
        assert parity.verdict == "failed", (fault, parity)
        assert names in message, (fault, message)
        for key in ("norm_before_residual", "d2t/t2d", "max_position_embeddings", "rope_theta",
                    "eagle_aux_hidden_state_layer_ids"):  # fmt: skip
            assert key in message
        if moves_steps:  # the step comparison itself sees it: the first step, both proposals
            first = parity.first_difference
            assert first is not None and parity.differing_steps >= 3, (fault, parity)
            assert first.gap_steps is None or first.gap_steps > first.tie_bound_steps
            assert "first difference: prompt" in message and "predicted " in message and "served " in message
        else:
            assert parity.differing_steps == 0
            assert "the served draft's files are not the trainer's checkpoint" in message
