"""bench/gpu/stage_peaks.py: each stage's window from a Snakemake log and its peak from the GPU samples."""

from __future__ import annotations

import importlib.util
import sys

from conftest import REPO

SPEC = importlib.util.spec_from_file_location("stage_peaks", REPO / "bench" / "gpu" / "stage_peaks.py")
stage_peaks = importlib.util.module_from_spec(SPEC)
sys.modules["stage_peaks"] = stage_peaks  # dataclasses resolve their module's annotations through sys.modules
SPEC.loader.exec_module(stage_peaks)

LOG = """\
[Sun Dec  6 07:24:05 2026]
localrule build_target:
    output: results/run/target
[Sun Dec  6 07:25:29 2026]
Finished jobid: 1 (Rule: build_target)
1 of 3 steps (33%) done
[Sun Dec  6 07:25:29 2026]
rule canary:
[Sun Dec  6 07:26:10 2026]
Error in rule canary:
[Sun Dec  6 07:26:12 2026]
localrule extract:
2026-12-06 07:27:00,000 INFO eagle3: a line of the stage's own
[Sun Dec  6 07:28:00 2026]
"""

CSV = """\
2026/12/06 07:25:29.500, 13000 MiB, 90 %
2026/12/06 07:25:40.000, 9000 MiB, 50 %
2026/12/06 07:26:30.000, 60000 MiB, 100 %
garbage line
"""


def test_windows_close_on_finished_or_error_and_a_job_without_a_close_is_cut_at_the_last_stamp():
    windows = stage_peaks.stage_windows(LOG)
    assert [(w.rule, w.status) for w in windows] == [
        ("build_target", "finished"),
        ("canary", "failed"),
        ("extract", "cut"),
    ]
    assert [(w.end - w.start).total_seconds() for w in windows] == [84, 41, 108]


def test_a_stage_peak_leaves_out_the_previous_jobs_second():
    peaks = stage_peaks.stage_peaks(stage_peaks.stage_windows(LOG), stage_peaks.gpu_samples(CSV))
    by_rule = {p.rule: p for p in peaks}
    assert by_rule["build_target"].peak_gpu_mib == 13000  # its last second's sample is its own
    assert by_rule["canary"].peak_gpu_mib == 9000  # not the build's 13000 from the second the canary started in
    assert by_rule["extract"].peak_gpu_mib == 60000 and by_rule["extract"].samples == 1
