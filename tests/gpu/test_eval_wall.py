"""bench/gpu/eval_wall.py: where evaluate_draft's wall goes, from its logs and work folder (issue #42)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO

SPEC = importlib.util.spec_from_file_location("eval_wall", REPO / "bench" / "gpu" / "eval_wall.py")
eval_wall = importlib.util.module_from_spec(SPEC)
sys.modules["eval_wall"] = eval_wall
SPEC.loader.exec_module(eval_wall)

W = "/root/work/results/r/eval/work"
CUT = f"""2026-12-07 11:56:26,492 INFO eagle3: stage evaluate_draft: start
2026-12-07 11:56:26,564 INFO eagle3.runtime: the measurement process (no_speculation), started before its spec: python3 -m m --spec {W}/measure_0.spec.json --result x
[eval-vllm] vllm 0.26.0 imported in 9.8 s (production kernels)
2026-12-07 11:58:17,757 INFO eagle3.evaluation: measurement process measure_0 done in 111.2 s
2026-12-07 11:58:17,758 INFO eagle3.runtime: the measurement process (trained): python3 -m m --spec {W}/measure_1.spec.json --result y
[eval-vllm] vllm 0.26.0 imported in 8.6 s (production kernels)
2026-12-07 12:00:17,000 WARNING eagle3: stage evaluate_draft stopped by SIGTERM; the rerun resumes
"""
RESUMED = f"""2026-12-07 12:01:53,483 INFO eagle3: stage evaluate_draft: start
2026-12-07 12:01:53,557 INFO eagle3.runtime: the measurement process (no_speculation), started before its spec: python3 -m m --spec {W}/measure_0.spec.json --result x
2026-12-07 12:02:08,379 INFO eagle3.evaluation: measure_0, started early, is not the process to run first (measure_1; batch_invariant False, environment variables changed: none): stopped
2026-12-07 12:02:09,504 INFO eagle3.runtime: the measurement process (trained): python3 -m m --spec {W}/measure_1.spec.json --result y
[eval-vllm] vllm 0.26.0 imported in 12.2 s (production kernels)
2026-12-07 12:03:32,499 INFO eagle3.evaluation: measurement process measure_1 done in 83.0 s
2026-12-07 12:03:32,501 INFO eagle3.runtime: the measurement process (trained): python3 -m m --spec {W}/measure_2.spec.json --result z
[eval-vllm] vllm 0.26.0 imported in 9.6 s (batch_invariant kernels)
2026-12-07 12:04:04,001 INFO eagle3.evaluation: measurement process measure_2 done in 31.5 s
2026-12-07 12:04:24,001 INFO eagle3: stage evaluate_draft: done
"""


def timing(engine: float, passes: list[float]) -> dict:
    return {
        "engine_start_s": engine,
        "generate_s": 0.0,
        "timings": [{"seconds": min(passes), "seconds_passes": passes}],
    }


def test_a_cut_attempt_and_its_resume_add_up_to_the_stages_wall(tmp_path):
    (tmp_path / "runs").mkdir()
    # measure_0's spec was replaced by the resumed attempt: its result is found by label and kernels
    for n, name in ((1, "trained.timing.json"), (2, "trained.lossless.json")):
        spec = {"runs": [{"result_path": f"{W}/runs/{name}"}], "batch_invariant": n == 2}
        (tmp_path / f"measure_{n}.spec.json").write_text(json.dumps(spec))
    runs = {
        "no_speculation.timing.json": timing(48.0, [7.0, 7.2]),
        "trained.timing.json": timing(40.0, [8.0, 8.5]),
        "trained.lossless.json": {"engine_start_s": 9.0, "generate_s": 2.0, "timings": []},
        "trained.timing.key.json": {"engine_start_s": 1e9},  # a key file is not a result
    }
    for name, body in runs.items():
        (tmp_path / "runs" / name).write_text(json.dumps(body))
    attempts = [eval_wall.parse_attempt(CUT), eval_wall.parse_attempt(RESUMED)]
    assert [a["finished"] for a in attempts] == [False, True]
    specs = {p.name.removesuffix(".spec.json"): json.loads(p.read_text()) for p in tmp_path.glob("measure_*.spec.json")}
    results = {p.name: json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json") if ".key." not in p.name}
    out = eval_wall.breakdown(attempts, specs, results)
    parts = out["parts"]
    assert out["stage_wall_s"] == 231 + 151  # 11:56:26-12:00:17, 12:01:53-12:04:24
    assert parts["cut_processes_s"] == 120  # measure_1 of the cut attempt: 11:58:17 to the attempt's last line
    assert parts["stopped_early_s"] == 15  # 12:01:53 to 12:02:08
    assert parts["engine_start_s"] == pytest.approx(48 + 40 + 9)
    assert parts["generate_s"] == pytest.approx(14.2 + 16.5 + 2.0)
    assert parts["import_s"] == pytest.approx(9.8 + 12.2 + 9.6)
    # every second of the stage is in one part
    assert sum(parts.values()) == pytest.approx(out["stage_wall_s"])
    assert parts["outside_processes_s"] == pytest.approx(382 - 111.2 - 83.0 - 31.5 - 120 - 15)
