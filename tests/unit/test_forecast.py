"""The forecast's arithmetic (eagle3_workflow.forecast): parameters per token against published counts, the scaling
of measured rates, and the command's refusals."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import REPO

from eagle3_workflow.forecast.__main__ import main
from eagle3_workflow.forecast.model import (
    CostTable,
    MeasuredRate,
    RunShape,
    as_json,
    cost_table,
    extraction_forecast,
    training_forecast,
)
from eagle3_workflow.forecast.shape import active_params_per_token, draft_params_per_token
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.trainer.checkpoint_size import draft_tensors

PRESET_8B = REPO / "config" / "presets" / "llama-3.1-8b.yaml"
SHAPE = ["--target-config", str(REPO / "bench" / "gpu" / "llama8b-shape-config.json")]
LLAMA_8B = json.loads((REPO / "bench" / "gpu" / "llama8b-shape-config.json").read_text())
KIMI_K2 = {  # Kimi-K2 / K2.5's text_config, as released
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "intermediate_size": 18432, "first_k_dense_replace": 1, "vocab_size": 163840,
}  # fmt: skip


def test_llama_8b_counts_its_published_parameters_less_the_embedding_and_norms():
    # Llama-3.1-8B: 8,030,261,248 parameters; a token does not multiply the embedding (128,256 x 4,096) or use the
    # 65 RMSNorm weight vectors as a matrix
    assert active_params_per_token(LLAMA_8B) == 8_030_261_248 - 128_256 * 4_096 - 65 * 4_096


def test_kimi_and_deepseek_v3_count_their_published_activated_parameters():
    # Moonshot: Kimi-K2 "32B activated"; DeepSeek: V3 "37B activated" (both with the embedding, ~1B)
    assert active_params_per_token(KIMI_K2) == pytest.approx(32e9, rel=0.03)
    deepseek_v3 = KIMI_K2 | {"num_attention_heads": 128, "n_routed_experts": 256, "vocab_size": 129_280,
                             "first_k_dense_replace": 3}  # fmt: skip
    assert active_params_per_token(deepseek_v3) == pytest.approx(37e9, rel=0.03)


def test_an_mla_targets_draft_is_the_one_speculators_built_on_the_h100():
    """The real-width Kimi stand-in's draft (issue #41, third lease): 64 heads of head_dim 64 (the rope part, as
    transformers' DeepSeek-V3 config resolves head_dim), its model.safetensors 3,868,466,880 bytes. A token passes
    the fc, that layer and the draft vocabulary's lm_head: the checkpoint's trained matrices and its lm_head."""
    tensors = draft_tensors(KIMI_K2, draft_layers=1, draft_vocab_size=512, captured_layers=3)
    assert draft_params_per_token(KIMI_K2, 512) == tensors.trained_matrices + 512 * 7168
    attention = 2 * 7168 * 3 * (64 * 64) + 64 * 64 * 7168  # q, k, v from [embedding; hidden], o
    assert draft_params_per_token(KIMI_K2, 512) == 3 * 7168**2 + attention + 3 * 7168 * 18432 + 7168 * 512


def test_a_layout_the_forecast_cannot_count_is_refused_with_the_keys_it_needs():
    with pytest.raises(StageError, match=r"no \['intermediate_size'\].*--target-config"):
        active_params_per_token({k: v for k, v in LLAMA_8B.items() if k != "intermediate_size"})


def run_shape(**changes) -> RunShape:
    base = dict(
        samples=1000, tokens=1_000_000, tokens_source="test", target_params_per_token=2_000_000_000,
        draft_params_per_token=100_000_000, hidden_size=64, captured_ids=4, replicas=2, gpus_per_replica=2,
        train_gpus=4, epochs=3, train_data_ratio=0.5,
    )  # fmt: skip
    return RunShape(**(base | changes))


COSTS = CostTable(
    machine="test",
    extraction=MeasuredRate(tokens_per_s=1000.0, params_per_token=1_000_000_000, start_s=50.0, source="x"),
    training=MeasuredRate(tokens_per_s=500.0, params_per_token=200_000_000, start_s=100.0, source="y"),
)


def test_a_start_measured_on_another_model_says_it_is_not_scaled():
    """Starts are not scaled to a model (the real-width Kimi stand-in's extraction server started in 2.4x the 8B
    shape's, its training's fixed cost was 0.68x): the basis says whose start it is, where the model differs."""
    other = extraction_forecast(run_shape(), COSTS).basis
    assert other.endswith("each starting in 50 s (start measured on the 1.00B reference, not scaled to this model)")
    same = run_shape(target_params_per_token=1_000_000_000, draft_params_per_token=200_000_000)
    assert extraction_forecast(same, COSTS).basis.endswith("each starting in 50 s")
    assert "100 s fixed per run; disk" not in training_forecast(same, COSTS).basis  # no checkpoint size given
    assert training_forecast(same, COSTS).basis.endswith("100 s fixed per run")
    assert "(start measured on the 0.20B reference, not scaled" in training_forecast(run_shape(), COSTS).basis


def test_several_fresh_nodes_starts_give_their_mean_and_their_range():
    """Two H100 hosts of one kind started the 8B shape's extraction server in 107.75 and 74.82 s (the host's CPU:
    imports and torch.compile): the forecast takes the mean, and its basis and JSON carry the range."""
    raw = {
        "machine": "test",
        "extraction": {"tokens_per_s": 1000, "shape": "s", "starts_seen": [107.75, 74.82], "start_date": "d1 and d2",
                       "eager_start_s": 40.0, "date": "d0", "source": "x"},
        "training": {"tokens_per_s": 500, "shape": "s", "draft_vocab_size": 9, "start_s": 100.0, "date": "d0", "source": "y"},
    }  # fmt: skip
    costs = cost_table(raw, lambda shape, vocab: 10**9 if vocab is None else 2 * 10**8)
    assert costs.extraction.start_s == pytest.approx((107.75 + 74.82) / 2) and costs.training.start_s == 100.0
    same = run_shape(target_params_per_token=10**9, draft_params_per_token=2 * 10**8)
    row = extraction_forecast(same, costs)
    assert row.start_range == (74.82, 107.75)
    assert row.basis.endswith("each starting in 91 s (start: the mean of 2 fresh nodes' 75-108 s, measured d1 and d2)")
    assert extraction_forecast(run_shape(eager=True), costs).start_range is None  # the eager start is one figure
    assert training_forecast(same, costs).start_range is None
    stages = as_json([row], same, costs)["stages"]
    assert [s.get("range") for s in stages if s["quantity"] == "start"] == [[74.82, 107.75]]
    with pytest.raises(ValueError, match="both start_s and starts_seen"):
        cost_table(raw | {"extraction": raw["extraction"] | {"start_s": 1.0}}, lambda shape, vocab: 1)


def test_extraction_scales_the_measured_rate_by_parameters_and_spreads_it_over_every_gpu():
    row = extraction_forecast(run_shape(), COSTS)
    # 1e6 tokens at twice the reference's parameters: 2,000 GPU-seconds; 2 replicas x 2 GPUs share them
    assert row.wall_s == pytest.approx(50 + 2000 / 4)
    assert row.gpu_hours == pytest.approx(4 * (50 + 500) / 3600)
    assert row.disk_bytes == 1_000_000 * 4 * 64 * 2


def test_training_scales_by_the_draft_and_counts_only_the_training_rows_each_epoch():
    row = training_forecast(run_shape(), COSTS)
    # 3 epochs x 500,000 training tokens at half the reference draft's parameters: 1,500 GPU-seconds over 4 GPUs
    assert row.wall_s == pytest.approx(100 + 1500 / 4)
    assert row.gpu_hours == pytest.approx(4 * 475 / 3600)


def test_the_plan_of_the_published_8b_preset(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no results/ here: the data's size comes from the flags
    out = tmp_path / "forecast.json"
    code = main(
        ["--configfile", str(PRESET_8B), *SHAPE, "--samples", "1000", "--mean-tokens", "100", "--json", str(out)]
    )
    assert code == 0, capsys.readouterr().err
    stages = {(s["stage"], s["quantity"]): s for s in json.loads(out.read_text())["stages"]}
    # the reference shape itself: 100,000 tokens at the measured rate on 8 replicas of one GPU, each paying the
    # server's start with compilation and CUDA graphs (the preset serves with vllm.enforce_eager false)
    rate = yaml.safe_load((REPO / "config" / "costs" / "h200.yaml").read_text())["extraction"]
    per_token = 100_000 / rate["tokens_per_s"] / 8
    start = sum(rate["starts_seen"]) / len(rate["starts_seen"])  # every fresh node's start measured: their mean
    assert stages["extract_hidden_states", "per_token"]["forecast"] == pytest.approx(per_token, rel=1e-3)
    assert stages["extract_hidden_states", "start"]["forecast"] == pytest.approx(start) != rate["eager_start_s"]
    assert stages["extract_hidden_states", "start"]["range"] == [min(rate["starts_seen"]), max(rate["starts_seen"])]
    assert stages["extract_hidden_states", "wall"]["forecast"] == pytest.approx(start + per_token, rel=1e-4)
    assert stages["extract_hidden_states", "disk"]["forecast"] == 100_000 * 4 * 4096 * 2
    assert "evaluate_draft" in capsys.readouterr().out  # listed, without a figure


def test_the_plan_prints_terabytes_where_the_hidden_states_pass_a_thousand_gigabytes(capsys, tmp_path, monkeypatch):
    """500k samples of 1,024 tokens, 4 layers of 4,096 in bf16: 16.8 TB, not '16777.2 GB'."""
    monkeypatch.chdir(tmp_path)
    assert main(["--configfile", str(PRESET_8B), *SHAPE, "--samples", "500000", "--mean-tokens", "1024"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "16.8 TB" in rows["extract_hidden_states"]  # 512,000,000 tokens x 32,768 bytes
    assert "32.7 GB" in rows["train_draft"]  # below 1,000 GB: gigabytes as before


def test_an_eager_run_pays_the_eager_start_and_each_forecast_keeps_its_two_parts():
    costs = CostTable(
        machine="test",
        extraction=MeasuredRate(tokens_per_s=1000.0, params_per_token=10**9, start_s=100.0, source="x", eager_start_s=40.0),
        training=COSTS.training,
    )  # fmt: skip
    served = extraction_forecast(run_shape(), costs)
    eager = extraction_forecast(run_shape(eager=True), costs)
    assert (served.start_s, eager.start_s) == (100.0, 40.0)
    assert served.per_token_s == eager.per_token_s == pytest.approx(2000 / 4)
    assert eager.wall_s == pytest.approx(40 + 500)
    # a table without an eager start (an older one) keeps its one start for both
    assert extraction_forecast(run_shape(eager=True), COSTS).start_s == 50.0
    trained = training_forecast(run_shape(), COSTS)
    assert trained.start_s + trained.per_token_s == pytest.approx(trained.wall_s)


def test_a_plan_without_the_data_size_or_for_a_cpu_preset_says_what_to_give(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--configfile", str(PRESET_8B), *SHAPE]) == 2
    assert "--mean-tokens" in capsys.readouterr().err
    tiny = str(REPO / "config" / "presets" / "tiny.yaml")
    assert main(["--configfile", tiny, *SHAPE, "--samples", "9", "--mean-tokens", "9"]) == 2
    assert "forecast is for GPU runs" in capsys.readouterr().err


def test_prepare_datas_manifest_gives_the_size_once_it_exists(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "results" / "llama-3.1-8b" / "data" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"records_kept": 320, "total_tokens": 22_937}))
    assert main(["--configfile", str(PRESET_8B), *SHAPE]) == 0
    assert (
        "320 samples, 22,937 tokens (prepare_data's results/llama-3.1-8b/data/manifest.json)" in capsys.readouterr().out
    )


def test_training_disk_is_the_checkpoints_and_the_draft_the_8b_shape_run_wrote(capsys, tmp_path, monkeypatch):
    """train_draft's disk: every saved epoch's checkpoint (speculators keeps them all) and the published draft. The
    8B-shape speed run of 2026-12-06 (H100, 3 epochs, draft vocab 32,000, AdamW) left 9,231,598,461 bytes in
    train_work (9,225,015,890 of them checkpoints) and 1,900,548,048 in draft/
    (bench/gpu/results/2026-12-06-llama8b-shape-speed/calls/du-after-call3.txt); the forecast of that config says
    the same to 0.1% (each checkpoint's small files are estimated at 1 MiB)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "forecast.json"
    configs = [str(REPO / "bench" / "gpu" / name) for name in ("llama8b-shape.yaml", "llama8b-shape-speed.yaml")]
    code = main(["--configfile", *configs, *SHAPE, "--samples", "600", "--mean-tokens", "702", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    stages = {(s["stage"], s["quantity"]): s for s in json.loads(out.read_text())["stages"]}
    assert stages["train_draft", "disk"]["forecast"] == pytest.approx(9_231_598_461 + 1_900_548_048, rel=1e-3)
    assert "3 checkpoint(s) of 3.08 GB, all kept, and the published draft's 1.90 GB" in capsys.readouterr().out


def test_the_forecast_beside_speculators_published_llama_8b_run_is_the_one_committed(capsys, tmp_path, monkeypatch):
    """docs/benchmarks.md sets the forecast of speculators' published 5k-sample Llama-3.1-8B run (2 GPUs, 5 epochs)
    beside that run's times. The committed figures are what the overlay and the cost table give now (a change to
    either must refresh them), and the hidden states' size agrees with speculators' tutorial: ~1.6 TB for 50,000
    samples of 1,024 tokens."""
    monkeypatch.chdir(tmp_path)
    overlay = REPO / "bench" / "gpu" / "study" / "forecast-speculators-llama8b-5k.yaml"
    out = tmp_path / "forecast.json"
    args = ["--configfile", str(PRESET_8B), str(overlay), *SHAPE, "--samples", "5000", "--mean-tokens", "1024"]
    assert main([*args, "--json", str(out)]) == 0, capsys.readouterr().err
    committed = (
        REPO / "bench" / "gpu" / "results" / "2026-12-07-llama8b-shape-1200" / "forecast_speculators_5k_2gpus.json"
    )
    assert json.loads(out.read_text()) == json.loads(committed.read_text())
    stages = {(s["stage"], s["quantity"]): s["forecast"] for s in json.loads(out.read_text())["stages"]}
    assert 10 * stages["extract_hidden_states", "disk"] == pytest.approx(1.6e12, rel=0.1)
