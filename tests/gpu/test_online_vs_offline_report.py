"""online_vs_offline_gpu.py's report: the configured requests-in-flight count runs first (the goal's figure), and
the report on disk before each further mode holds what finished, marked unfinished, so a device call cut inside a
later mode keeps the goal's ratio. No GPU: the rows are what run_mode returns."""

from __future__ import annotations

import json

from conftest import REPO, load_script

SCRIPT = REPO / "bench" / "gpu" / "online_vs_offline_gpu.py"


def row(mode: str, trainer_s: float, steps: int = 40, rif: int | None = None) -> dict:
    found = {"mode": mode, "wall_s": trainer_s + (0 if rif is None else 100.0), "trainer_s": trainer_s,
             "steps_per_s": round(steps / trainer_s, 3), "hidden_states_peak_bytes": 1000 if rif is None else 10,
             "train_work_peak_bytes": 500}  # fmt: skip
    return found if rif is None else found | {"requests_in_flight": rif}


def test_the_configured_count_runs_first_and_each_other_count_once():
    bench = load_script(SCRIPT)
    assert bench.mode_order(8, [1]) == [8, 1]
    assert bench.mode_order(8, [1, 1, 8, 4]) == [8, 1, 4]
    assert bench.mode_order(1, [1]) == [1]


def test_a_report_cut_after_the_configured_mode_holds_its_ratio_and_says_unfinished(tmp_path):
    bench = load_script(SCRIPT)
    head = {"run_dir": "r", "rows": 600, "epochs": 1, "num_workers": 4}
    offline, online = row("offline", 80.0), row("online", 100.0, rif=8)
    before = bench.report_of(head, offline, [], 8, finished=False)
    assert before["online_over_offline"] == {} and before["by_requests_in_flight"] == {} and not before["finished"]
    cut = bench.report_of(head, offline, [online], 8, finished=False)
    assert cut["online_over_offline"]["steps_per_s"] == round(0.4 / 0.5, 3)
    assert cut["online_over_offline"]["peak_disk_bytes"] == round(510 / 1500, 3)
    assert cut["by_requests_in_flight"] == {"8": {"steps_per_s": 0.8, "trainer_s": 1.25}}
    out = tmp_path / "report.json"
    bench.write_partial(cut, out)
    assert json.loads(out.read_text())["finished"] is False
    done = bench.report_of(head, offline, [online, row("online-rif1", 200.0, rif=1)], 8, finished=True)
    assert done["finished"] and done["online_over_offline"] == cut["online_over_offline"]
    assert done["by_requests_in_flight"]["1"] == {"steps_per_s": 0.4, "trainer_s": 2.5}
    assert [m["mode"] for m in done["modes"]] == ["offline", "online", "online-rif1"]


def test_the_steady_rate_leaves_out_the_first_steps_and_needs_three():
    bench = load_script(SCRIPT)
    # five slow first steps (compilation, first fetches), then 200 ms steps: 5 steps/s, whatever came first
    assert bench.steady_steps_per_s([30_000.0] * 5 + [200.0] * 10) == 5.0
    assert bench.steady_steps_per_s([30_000.0] * 5 + [200.0, float("nan"), 200.0, 200.0]) == 5.0
    assert bench.steady_steps_per_s([200.0] * 7) is None  # two steady steps say nothing


def test_the_steady_ratio_stands_beside_the_wall_clock_one_and_a_side_without_it_is_left_out():
    bench = load_script(SCRIPT)
    head = {"run_dir": "r", "rows": 600, "epochs": 1, "num_workers": 4}
    offline = row("offline", 80.0) | {"steady_steps_per_s": 6.0}
    online = row("online", 100.0, rif=8) | {"steady_steps_per_s": 5.4}
    report = bench.report_of(head, offline, [online], 8, finished=True)
    assert report["online_over_offline"]["steady_steps_per_s"] == 0.9
    assert report["by_requests_in_flight"]["8"]["steady_steps_per_s"] == 0.9
    unlogged = row("online-rif1", 200.0, rif=1) | {"steady_steps_per_s": None}
    report = bench.report_of(head, offline, [online, unlogged], 8, finished=True)
    assert "steady_steps_per_s" not in report["by_requests_in_flight"]["1"]


def test_online_first_runs_the_configured_online_mode_before_offline_and_reports_no_ratio_until_offline_ran():
    bench = load_script(SCRIPT)
    assert bench.mode_plan(8, [1]) == [None, 8, 1]
    assert bench.mode_plan(8, [1], online_first=True) == [8, None, 1]
    assert bench.mode_plan(8, [8], online_first=True) == [8, None]
    head = {"run_dir": "r", "rows": 600, "epochs": 1, "num_workers": 4}
    online = row("online", 100.0, rif=8)
    cut = bench.report_of(head, None, [online], 8, finished=False)
    assert cut["online_over_offline"] == {} and cut["by_requests_in_flight"] == {}
    assert [m["mode"] for m in cut["modes"]] == ["online"]
    done = bench.report_of(head, row("offline", 80.0), [online], 8, finished=True)
    assert done["online_over_offline"]["steps_per_s"] == 0.8


def test_a_ratio_of_zero_is_kept_and_a_missing_side_is_left_out():
    bench = load_script(SCRIPT)
    offline = {"hidden_states_peak_bytes": 1000, "steady_steps_per_s": 6.0, "wall_s": 0}
    online = {"hidden_states_peak_bytes": 0, "steady_steps_per_s": None, "wall_s": 5}
    keys = ("hidden_states_peak_bytes", "steady_steps_per_s", "wall_s")
    assert bench.online_over_offline(offline, online, keys) == {"hidden_states_peak_bytes": 0.0}
