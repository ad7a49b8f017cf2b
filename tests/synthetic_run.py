"""Artefacts of a finished run, written without running the stages, so the last rules (evaluate_draft,
summarize_run, report, package_draft) can run alone through Snakemake: every file is its files/*_artefacts.py model, written
with files.artefacts.write, and their mtimes follow the DAG's order so that `--rerun-triggers mtime` finds every upstream
job done."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from eagle3_workflow.files.artefacts import Artefact, CheckRow, write
from eagle3_workflow.files.data_artefacts import CanaryReport, DataManifest, ExtractionManifest, ValidationReport
from eagle3_workflow.files.draft_artefacts import (
    AcceptanceReport,
    AcceptanceResult,
    CheckpointInfo,
    LosslessMismatch,
    MeasurementProcess,
    Provenance,
    Throughput,
    TrainingSummary,
)
from eagle3_workflow.files.target_artefacts import ApiCompatReport, TargetInfo


def _dump(path: Path, artefact: Artefact) -> Path:
    write(path, artefact)
    return path


def acceptance_report(num_speculative_tokens: int = 3, *, mismatches: int = 0) -> AcceptanceReport:
    def result(label: str, rates: list[float], tps: float) -> AcceptanceResult:
        drafts = 100
        per_pos = [int(r * drafts) for r in rates]
        found = [
            LosslessMismatch(prompt_index=i, origin=f"row {i}", position=3, expected_token=17, found_token=18,
                             reference_gap_steps=0.0, candidate_gap_steps=0.0, tie=True, context="the cat", expected_text=" sat",
                             found_text=" sits")
            for i in range(mismatches)
        ]  # fmt: skip
        return AcceptanceResult(
            label=label, draft_path=f"/runs/{label}", mean_acceptance_length=1 + sum(per_pos) / drafts,
            per_position_acceptance=rates, num_drafts=drafts, draft_tokens=drafts * num_speculative_tokens,
            accepted_tokens=sum(per_pos), tokens_per_s=tps, accepted_per_position=per_pos,
            draft_acceptance_rate=sum(per_pos) / (drafts * num_speculative_tokens), generated_tokens=480,
            generate_s=480 / tps, speedup=tps / 100.0, engine_start_s=2.5, lossless=True, mismatches=found,
            throughput=[Throughput(concurrency=1, prompts=8, generated_tokens=240, seconds=240 / tps, tokens_per_s=tps,
                                   speedup=tps / 100.0, ms_per_step=10.0)],
        )  # fmt: skip

    return AcceptanceReport(
        num_prompts=16, prompt_source="heldout", num_speculative_tokens=num_speculative_tokens, max_tokens=48,
        trained=result("trained", [0.7, 0.5, 0.3][:num_speculative_tokens], 180.0),
        untrained=result("untrained", [0.01, 0.0, 0.0][:num_speculative_tokens], 90.0),
        no_speculation_tokens_per_s=100.0, lossless=True, lossless_mismatches=2 * mismatches,
        num_prompts_requested=16, prompt_detail="prepared rows 240..255 of 256", device="cpu",
        vllm_version="0.32.0", no_speculation_generated_tokens=480, no_speculation_generate_s=4.8,
        no_speculation_engine_start_s=2.4, lossless_numerics="production", lossless_tie_steps=0,
        lossless_criterion="exact", untrained_baseline="fresh weights",
        no_speculation_throughput=[Throughput(concurrency=1, prompts=8, generated_tokens=240, seconds=2.4,
                                              tokens_per_s=100.0, speedup=None, ms_per_step=10.0)],
        processes=[MeasurementProcess(runs=["no_speculation", "trained", "untrained"], wall_s=40.0, vllm_import_s=6.0,
                                      engine_start_s={"no_speculation": 2.4, "trained": 2.5, "untrained": 2.5},
                                      load_1m=1.5)],
        notes=["tokens/s measured on CPU: indicative only"],
    )  # fmt: skip


def api_compat_report(target: Path, checks: list[CheckRow]) -> ApiCompatReport:
    """check_api's record: the target as its config.json says (the workflow's one reader), else an 8-layer tiny one."""
    from eagle3_workflow.reference.target_config import read_target_config

    facts = (
        read_target_config(target).info() if (target / "config.json").exists()
        else TargetInfo(path=str(target), architecture="LlamaForCausalLM", model_type="llama", num_layers=8,
                        hidden_size=64, vocab_size=512)
    )  # fmt: skip
    return ApiCompatReport(
        passed=True, vllm_version="0.32.0", speculators_version="0.9.0", transformers_version="5.19.0",
        torch_version="2.13.0", device="cpu", layer_ids=[2, 4, 5, 8], checks=checks, target=facts,
    )  # fmt: skip


def training_summary(draft_dir: Path) -> TrainingSummary:
    """draft/training.json of a 2-epoch CPU training (as TRAINING_METRICS below logged it)."""
    final = CheckpointInfo(
        epoch=1, local_step=0, global_step=4, path=str(draft_dir.parent / "train_work/checkpoints/1")
    )
    return TrainingSummary(
        device="cpu", processes=1, command=["python", "-m", "eagle3_workflow.trainer.entry", "--epochs", "2"],
        attempts=1, resumed_from=None, final_checkpoint=final, epochs=2, steps=4, wall_s=60.0,
        target_layer_ids=[2, 4, 5], draft_vocab_size=256, vocab_mapping_sha256={"d2t": "d" * 64, "t2d": "e" * 64},
        final_train_loss=2.5, final_val_loss=2.6, final_val_full_acc=[0.4, 0.18], hidden_states="offline", online=None,
    )  # fmt: skip


TRAINING_METRICS = """attempt,split,epoch,global_step,loss,loss_0,loss_1,full_acc_0,full_acc_1,cond_acc_0,lr
1,train,0,0,5.1,2.6,2.5,0.05,0.01,0.05,0.001
1,train,0,1,4.2,2.2,2.0,0.10,0.03,0.20,0.001
1,val,0,2,4.0,2.1,1.9,0.12,0.04,0.25,
1,train,1,2,3.1,1.6,1.5,0.30,0.10,0.33,0.001
1,train,1,3,2.5,1.3,1.2,0.42,0.20,0.45,0.001
1,val,1,4,2.6,1.4,1.2,0.40,0.18,0.44,
"""


SHIPPED_DATA = Path(__file__).resolve().parent.parent / "config" / "data" / "tiny_conversations.jsonl"


def synthetic_data(workdir: Path) -> Path:
    """The synthetic run's data source: a copy of the shipped conversations in its working directory."""
    return workdir / "inputs" / SHIPPED_DATA.name


def write_synthetic_run(
    workdir: Path,
    run: str,
    *,
    target: Path,
    prepared: Path | None = None,
    draft: Path | None = None,
    acceptance: AcceptanceReport | None = None,
    training_metrics: str | None = TRAINING_METRICS,
) -> Path:
    """results/<run>/ with every artefact up to eval/acceptance.json (or up to draft/ when acceptance is None).

    prepared and draft are copied in when given (real ones), else minimal stand-ins are written. `target` must lie
    under `workdir` (its mtimes are set older than the run's); the run's data source is a copy of the shipped data
    under workdir (synthetic_data: conftest's synthetic_run_config points at it), so nothing outside workdir changes.
    """
    import shutil

    if not target.resolve().is_relative_to(workdir.resolve()):
        raise ValueError(f"target {target} is not under {workdir}: copy it there first (its mtimes are changed)")
    data = synthetic_data(workdir)
    data.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SHIPPED_DATA, data)
    out = workdir / "results" / run
    order: list[Path] = []

    def staged(path: Path) -> Path:
        order.append(path)
        return path

    _dump(staged(out / "provenance.json"), Provenance(
        run=run, created_unix=1.7e9, host="testhost", platform="Linux", python="3.11", git_commit="abc123",
        git_dirty=False, packages={"vllm": "0.32.0", "torch": "2.13.0"}, accelerators=[], config={"run": run},
        git_tree="9234bbbeae45000b95bf2d2fe12e20f2dc1de03f",
    ))  # fmt: skip
    prepared_dir = staged(out / "data" / "prepared")
    if prepared is not None:
        shutil.copytree(prepared, prepared_dir)
    else:
        prepared_dir.mkdir(parents=True)
        (prepared_dir / "dataset_info.json").write_text("{}")
    staged(out / "data" / "token_freq.pt").write_bytes(b"")
    _dump(staged(out / "data" / "manifest.json"), DataManifest(
        records_read=300, records_kept=256, dropped={"max_samples": 40, "no_assistant_tokens": 4}, truncated=3,
        total_tokens=40000, assistant_tokens=21000,
        length_percentiles={"p0": 20.0, "p10": 60.0, "p50": 150.0, "p90": 240.0, "p99": 256.0, "p100": 256.0,
                            "mean": 156.0},
        sources=["config/data/tiny_conversations.jsonl"], max_seq_len=256, prepared_dir=str(prepared_dir),
        token_freq_path=str(out / "data" / "token_freq.pt"),
    ))  # fmt: skip
    checks = [CheckRow(name="vllm version", expected=">=0.18.0,<0.34.0", found="0.32.0", passed=True)]
    _dump(staged(out / "checks" / "api_compat.json"), api_compat_report(target, checks))
    _dump(staged(out / "checks" / "canary.json"), CanaryReport(
        passed=True, device="cpu", canary_layers=4, canary_layer_ids=[2, 4], reference="HF transformers fp32",
        proof="hf_fp32", tolerance=0.05, per_layer_max_rel_error={"2": 0.004, "4": 0.006},
        per_layer_mean_rel_error={"2": 0.001, "4": 0.002}, samples=4, server_ready_s=15.0, checks=checks,
    ))  # fmt: skip
    _dump(staged(out / "hidden_states" / "replica_0.json"), ExtractionManifest(
        replica=0, replicas=1, samples_total=256, samples_extracted=200, samples_reused=56, tokens=40000,
        bytes_written=123456789, wall_s=80.0, server_ready_s=15.0, tokens_per_s=500.0,
        files_dir=str(out / "hidden_states" / "files"), rows=list(range(256)),
    ))  # fmt: skip
    _dump(staged(out / "hidden_states" / "validation.json"), ValidationReport(
        passed=True, samples_expected=256, samples_valid=256, missing=[], bad={}, tokens=40000, bytes=123456789,
        layer_count=4, hidden_size=64, files_dir=[str(out / "hidden_states" / "files")],
    ))  # fmt: skip
    draft_dir = staged(out / "draft")
    if draft is not None:
        shutil.copytree(draft, draft_dir)
    else:
        draft_dir.mkdir(parents=True)
        (draft_dir / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    if training_metrics is not None:
        (draft_dir / "metrics.csv").write_text(training_metrics)
        _dump(draft_dir / "training.json", training_summary(draft_dir))
    if acceptance is not None:
        _dump(staged(out / "eval" / "acceptance.json"), acceptance)

    # every file at least as new as everything it is made from; the inputs (the target, and the run's own copy of
    # the data, synthetic_data) older than all of them: only the mtimes of files under workdir change
    base = time.time() - 1000
    for path in [target, *target.rglob("*"), data.parent, data]:
        os.utime(path, (base - 10, base - 10))
    for i, path in enumerate(order):
        stamp = base + 10 * (i + 1)
        for member in [*(path.rglob("*") if path.is_dir() else []), path]:
            os.utime(member, (stamp, stamp))
    return out


def build_scratch_draft(
    target: Path, token_freq: dict[int, int], out_dir: Path, *, draft_vocab_size: int = 256, seed: int = 0
) -> Path:
    """An EAGLE-3 draft built from scratch with speculators (as its trainer does before step 0), saved in the
    layout train_draft publishes: config.json (speculators_model_type eagle3) + model.safetensors."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    from eagle3_workflow.files.hidden_states import eagle3_layer_ids

    num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    layer_config = create_transformer_layer_config(
        str(target), num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=2048, full_attention_indices=[0]
    )
    d2t, t2d = build_vocab_mappings_from_distribution(token_freq, draft_vocab_size, layer_config.vocab_size)
    torch.manual_seed(seed)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target),
        draft_vocab_size=draft_vocab_size, norm_before_residual=False, ttt_steps=3,
        target_layer_ids=eagle3_layer_ids(num_layers)[:-1], draft_attn_impl="sdpa",
    )  # fmt: skip
    model.save_pretrained(str(out_dir))
    return out_dir
