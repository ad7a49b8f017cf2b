"""bench/gpu/forecast_check.py: a device run's per-stage costs from its artefacts, and the forecast set against them."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO

SPEC = importlib.util.spec_from_file_location("forecast_check", REPO / "bench" / "gpu" / "forecast_check.py")
forecast_check = importlib.util.module_from_spec(SPEC)
sys.modules["forecast_check"] = forecast_check
SPEC.loader.exec_module(forecast_check)

ROOT = "/root/work/results/run"
DU = f"""580\t{ROOT}/data
29204056\t{ROOT}/checks/canary_work
13809816058\t{ROOT}/hidden_states
13809806080\t{ROOT}/hidden_states/files
9231598461\t{ROOT}/train_work
1900548048\t{ROOT}/draft
7\t/elsewhere/hidden_states
"""


def peak(rule: str, wall: float, status: str = "finished", mib: int | None = 70_000) -> dict:
    return {"rule": rule, "start": "2026-12-06T09:00:00", "wall_s": wall, "status": status, "peak_gpu_mib": mib}


def step(step_ms: float, tokens_per_s: float) -> dict:
    return {"metrics": {"profile": {"step_ms": step_ms, "tokens_per_s": tokens_per_s}}}


def test_du_rows_are_keyed_by_the_path_inside_the_run_folder():
    sizes = forecast_check.du_sizes(DU, ROOT + "/")
    assert sizes["hidden_states"] == 13_809_816_058 and sizes["draft"] == 1_900_548_048
    assert not any(k.startswith("/") for k in sizes)  # rows of another folder left out


def test_the_trainers_first_step_is_start_up_and_the_rest_is_per_token():
    rows = [step(120_000, 64.5), step(200, 50_000), {"metrics": {"val": {}}}, step(300, 40_000)]
    split = forecast_check.training_split(rows)
    assert split["first_step_s"] == 120.0
    assert split["steady_s"] == 0.5 and split["steady_tokens"] == 22_000
    assert split["steady_tokens_per_s"] == 44_000.0


def test_stages_take_the_finished_attempt_and_a_cpu_stage_holds_no_gpu_seconds():
    peaks = [
        peak("validate_hidden_states", 63, mib=4),
        peak("extract_hidden_states", 128),
        peak("train_draft", 100, status="cut"),
        peak("train_draft", 261),
        peak("evaluate_draft", 299, status="failed"),
        peak("evaluate_draft", 554, status="failed"),
    ]
    artefacts = {
        "replica": {"tokens": 421_336, "tokens_per_s": 34_464.7, "server_ready_s": 107.75},
        "training_split": {"steady_s": 26.4, "steady_tokens": 1_193_417, "steady_tokens_per_s": 45_205.2, "first_step_s": 120.0},
    }  # fmt: skip
    stages = {
        s["stage"]: s for s in forecast_check.measured_stages(peaks, forecast_check.du_sizes(DU, ROOT), artefacts, 1)
    }
    assert stages["validate_hidden_states"]["gpu_s"] == 0.0
    extract = stages["extract_hidden_states"]
    assert (extract["start_s"], extract["per_token_s"], extract["disk_bytes"]) == (107.75, 12.23, 13_809_816_058)
    train = stages["train_draft"]
    # the finished attempt's wall; the cut one still held the GPU
    assert (train["wall_s"], train["gpu_s"], train["start_s"]) == (261, 361.0, 234.6)
    assert train["disk_bytes"] == 9_231_598_461 + 1_900_548_048
    evaluate = stages["evaluate_draft"]
    assert evaluate["wall_s"] is None and evaluate["status"] == "failed" and evaluate["wall_s_all_attempts"] == 853


def test_each_forecast_part_gets_its_verdict_and_an_unfinished_stage_none():
    stages = [
        {"stage": "extract_hidden_states", "wall_s": 128.0, "gpu_s": 128.0, "disk_bytes": 100, "start_s": 107.75, "per_token_s": 12.23},
        {"stage": "evaluate_draft", "wall_s": None, "gpu_s": 853.0, "disk_bytes": 5},
    ]  # fmt: skip
    forecast = {
        "stages": [
            {"stage": "extract_hidden_states", "quantity": "start", "forecast": 57.1, "unit": "s"},
            {"stage": "extract_hidden_states", "quantity": "per_token", "forecast": 10.6, "unit": "s"},
            {"stage": "extract_hidden_states", "quantity": "disk", "forecast": 99, "unit": "bytes"},
            {"stage": "evaluate_draft", "quantity": "wall", "forecast": 600.0, "unit": "s"},
        ]
    }
    rows = forecast_check.compare(forecast, stages, "test")["stages"]
    verdicts = [(r["quantity"], r.get("within_25pct")) for r in rows]
    assert verdicts == [("start", False), ("per_token", True), ("disk", True), ("wall", None)]
    assert rows[0]["ratio"] == pytest.approx(57.1 / 107.75, abs=1e-3)


def test_du_snapshots_merge_at_each_paths_largest_size():
    """A snapshot taken after package_draft hard-linked the draft's weights into published_draft/ shows draft/ at
    0 bytes (du counts a linked file once): the merged sizes keep the earlier snapshot's 1.90 GB."""
    after_package = DU.replace(f"1900548048\t{ROOT}/draft", f"0\t{ROOT}/draft")
    after_package += f"1900548048\t{ROOT}/published_draft\n"
    merged = forecast_check.du_sizes_largest([DU, after_package], ROOT)
    assert merged["draft"] == 1_900_548_048 and merged["published_draft"] == 1_900_548_048
    assert merged["hidden_states"] == 13_809_816_058
    assert forecast_check.du_sizes_largest([after_package], ROOT)["draft"] == 0
