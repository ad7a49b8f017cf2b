"""The report: figures and tables from the run's artefacts (files/*_artefacts.py models; tolerant of missing training
metrics and unfamiliar columns). Through Snakemake, a real `snakemake --report` HTML made by rule `report`:
tests/integration/test_last_rules.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from synthetic_run import TRAINING_METRICS, acceptance_report, write_synthetic_run

from eagle3_workflow.files.artefacts import load, write
from eagle3_workflow.files.draft_artefacts import AcceptanceReport
from eagle3_workflow.report.figures import plot_training, read_training_metrics
from eagle3_workflow.report.pages import acceptance_page, html_table
from eagle3_workflow.report.stage import ReportInputs, ReportOutputs, nested_report_command, summarize_run


def report_paths(out: Path) -> tuple[ReportInputs, ReportOutputs]:
    inputs = ReportInputs(
        provenance=out / "provenance.json", manifest=out / "data" / "manifest.json",
        api_compat=out / "checks" / "api_compat.json", canary=out / "checks" / "canary.json",
        extraction=[out / "hidden_states" / "replica_0.json"], validation=out / "hidden_states" / "validation.json",
        draft=out / "draft", acceptance=out / "eval" / "acceptance.json",
    )  # fmt: skip
    names = {"summary": "summary.html", "data": "data.svg", "data_table": "data.html", "gates": "gates.html",
             "extraction": "extraction.svg", "extraction_table": "extraction.html", "training": "training.svg",
             "acceptance": "acceptance.svg", "acceptance_table": "acceptance.html", "provenance": "provenance.html"}  # fmt: skip
    return inputs, ReportOutputs(**{k: out / "report" / v for k, v in names.items()})


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    return write_synthetic_run(tmp_path, "t", target=target, acceptance=acceptance_report(mismatches=1))


def test_summarize_writes_every_figure_and_table(run_dir):
    inputs, outputs = report_paths(run_dir)
    summarize_run(inputs, outputs)
    for field in dataclasses.fields(outputs):
        path = getattr(outputs, field.name)
        assert path.exists(), path
        assert path.stat().st_size > 200, path
    summary = outputs.summary.read_text()
    assert "1.5" in summary
    assert "abc123" in summary  # trained acceptance length 1 + 150/100, git commit
    table = outputs.acceptance_table.read_text()
    assert "pos 3" in table
    assert "Greedy divergences" in table
    assert "indicative only" in table
    assert "<svg" in outputs.training.read_text()
    assert "FAIL" not in outputs.gates.read_text()


def test_an_untimed_untrained_draft_is_shown_as_not_timed_not_as_zero(tmp_path):
    report = acceptance_report()
    untimed = report.untrained.model_copy(update={"throughput": [], "tokens_per_s": 0.0, "speedup": 0.0})
    (tmp_path / "target").mkdir()
    run = write_synthetic_run(tmp_path, "t", target=tmp_path / "target",
                              acceptance=report.model_copy(update={"untrained": untimed}))  # fmt: skip
    inputs, outputs = report_paths(run)
    summarize_run(inputs, outputs)
    table = outputs.acceptance_table.read_text()
    assert "not timed" in table
    figure = outputs.acceptance.read_text()
    assert "x0.00" not in figure and "x1.80" in figure  # the trained draft's bar, none for the untimed one


def test_acceptance_report_round_trips_through_json(tmp_path):
    report = acceptance_report(mismatches=2)
    write(tmp_path / "acceptance.json", report)
    again = load(AcceptanceReport, tmp_path / "acceptance.json")
    assert again == report
    assert again.trained.mismatches[0].found_text == " sits"


@pytest.mark.parametrize(
    "csv",
    [
        TRAINING_METRICS,
        "epoch,train_loss,val_loss,acc_pos_1,acc_pos_2\n0,3.0,3.1,0.1,0.05\n1,2.0,2.2,0.3,0.2\n",  # other names
        "step,loss\n0,4.0\n1,3.5\n",  # no accuracy at all
        "note\nnothing numeric here\n",
    ],
)
def test_training_plot_tolerates_other_metric_layouts(tmp_path, csv):
    path = tmp_path / "metrics.csv"
    path.write_text(csv)
    plot_training(read_training_metrics(path), tmp_path / "training.svg", source=str(path))
    assert (tmp_path / "training.svg").stat().st_size > 1000


def test_missing_or_empty_metrics_give_a_figure_that_says_so(tmp_path):
    empty = tmp_path / "metrics.csv"
    empty.write_text("")
    assert read_training_metrics(empty) is None
    assert read_training_metrics(tmp_path / "absent.csv") is None
    plot_training(None, tmp_path / "training.svg", source="draft/metrics.csv")
    assert "no training metrics" in (tmp_path / "training.svg").read_text()


def test_tables_escape_what_they_show():
    assert "&lt;script&gt;" in html_table(["a"], [["<script>"]])
    page = acceptance_page(acceptance_report().model_copy(update={"notes": ["<b>loud</b>"]}))
    assert "<b>loud</b>" not in page


def test_nested_report_command_reads_the_same_workflow_without_the_lock():
    cmd = nested_report_command("/wf/Snakefile", Path("/w/cfg.json"), Path("results/t/report.html"), python="py")
    assert cmd[:3] == ["py", "-m", "snakemake"]
    assert ["--configfile", "/w/cfg.json"] == cmd[cmd.index("--configfile") : cmd.index("--configfile") + 2]
    assert "--nolock" in cmd
    assert cmd[-2:] == ["--report", "results/t/report.html"]


def test_the_acceptance_page_shows_the_draft_parity_and_the_lossless_reference():
    from eagle3_workflow.files.draft_artefacts import DraftParity

    parity = DraftParity(verdict="passed", prompts=[0, 1, 2, 3], steps_compared=149, agreeing_steps=147,
                         ties_excused=2, differing_steps=0, proposals_compared=420, dtype="bfloat16",
                         roundings=[5, 6, 7], tie_sigmas=4.0, reference="speculators Eagle3DraftModel, fp32",
                         independent=True)  # fmt: skip
    report = acceptance_report().model_copy(update={"parity": parity, "lossless_reference": "untrained"})
    page = acceptance_page(report)
    assert "passed: 147 of 149 served steps agree, 2 near-ties excused, 0 differ" in page
    assert "lossless reference" in page and "untrained" in page
    assert "not recorded" in acceptance_page(acceptance_report())  # an acceptance.json from before the check
