"""Rules `summarize_run` and `report`: the run's figures and tables, bundled as a real Snakemake report.

How report.html is made (and why). The goal is Snakemake's own report (figures with captions, the rule graph,
runtimes, the code of every rule), and also `report.html` as an output of rule `report`, so `snakemake` alone
makes it and `rule all` can ask for it. Two rules do that:

- `summarize_run` reads the artefacts and writes figures (SVG) and tables (small HTML pages) under
  ``results/<run>/report/``, each flagged with ``report(..., caption=..., category=...)`` (captions in
  ``workflow/report/``). ``snakemake --report`` run by hand on the same config therefore also works.
- `report` runs ``python -m snakemake -s <Snakefile> --configfile <resolved config> --nolock --report
  results/<run>/report.html`` on this same workflow, in its working directory, as a runtime child
  (runtime.worker.run_command): it dies with the stage, its output goes into the rule's log.

Why two rules: Snakemake marks the outputs of a running job incomplete, and ``--report`` refuses incomplete
files (``create_report`` has no ``--ignore-incomplete``); when `report` runs, `summarize_run` has finished.
``--nolock`` because the outer Snakemake holds the working directory's lock (a report only reads). The nested
call gets the outer run's resolved config (every default filled, every ``--config`` override applied), so it
builds the same DAG. Tested end to end in tests/integration/test_last_rules.py; the nested command on its own in
tests/unit/test_report.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.data_artefacts import CanaryReport, DataManifest, ExtractionManifest, ValidationReport
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, Provenance, TrainingSummary
from eagle3_workflow.files.target_artefacts import ApiCompatReport
from eagle3_workflow.files.writing import write_text_atomic
from eagle3_workflow.report.figures import (
    plot_acceptance,
    plot_data,
    plot_extraction,
    plot_training,
    read_training_metrics,
)
from eagle3_workflow.report.pages import (
    acceptance_page,
    data_page,
    extraction_page,
    gates_page,
    provenance_page,
    summary_page,
)
from eagle3_workflow.settings.errors import StageError

log = logging.getLogger("eagle3.report")


@dataclasses.dataclass
class ReportInputs:
    provenance: Path
    manifest: Path
    api_compat: Path
    canary: Path
    extraction: list[Path]
    validation: Path
    draft: Path
    acceptance: Path


@dataclasses.dataclass
class ReportOutputs:
    summary: Path
    data: Path
    data_table: Path
    gates: Path
    extraction: Path
    extraction_table: Path
    training: Path
    acceptance: Path
    acceptance_table: Path
    provenance: Path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def summarize_run(inputs: ReportInputs, outputs: ReportOutputs) -> None:
    """Write every figure and table of the report from the artefacts."""
    provenance = load(Provenance, inputs.provenance)
    manifest = load(DataManifest, inputs.manifest)
    extraction = [load(ExtractionManifest, p) for p in inputs.extraction]
    acceptance = load(AcceptanceReport, inputs.acceptance)
    metrics_path = inputs.draft / "metrics.csv"
    metrics = read_training_metrics(metrics_path)
    training = load(TrainingSummary, inputs.draft / "training.json")
    gates = (
        load(ApiCompatReport, inputs.api_compat),
        load(CanaryReport, inputs.canary),
        load(ValidationReport, inputs.validation),
    )

    plot_data(manifest, outputs.data)
    _write(outputs.data_table, data_page(manifest))
    _write(outputs.gates, gates_page(*gates))
    plot_extraction(extraction, outputs.extraction)
    _write(outputs.extraction_table, extraction_page(extraction))
    plot_training(metrics, outputs.training, source=str(metrics_path))
    plot_acceptance(acceptance, outputs.acceptance)
    _write(outputs.acceptance_table, acceptance_page(acceptance))
    _write(outputs.provenance, provenance_page(provenance))
    summary = summary_page(
        provenance=provenance,
        manifest=manifest,
        extraction=extraction,
        training=training,
        metrics=metrics,
        acceptance=acceptance,
    )
    _write(outputs.summary, summary)


def nested_report_command(
    snakefile: str, config_path: Path, html_path: Path, python: str = sys.executable
) -> list[str]:
    return [
        python,
        "-m",
        "snakemake",
        "-s",
        snakefile,
        "--configfile",
        str(config_path),
        "--nolock",
        "--report",
        str(html_path),
    ]


def build_report(snakefile: str, config: dict[str, Any], html_path: Path, work_dir: Path, log_path: str | None) -> None:
    """Run Snakemake's report on this workflow, with the outer run's resolved config. The nested Snakemake is a
    runtime child: its lines go into the rule's log, and it dies with the stage (even on SIGKILL)."""
    from eagle3_workflow.runtime.worker import Job, run_command

    config_path = work_dir / "resolved_config.json"
    write_text_atomic(config_path, json.dumps(config, indent=2, default=str) + "\n")
    cmd = nested_report_command(snakefile, config_path, html_path)
    log.info("building the Snakemake report: %s", " ".join(cmd))
    wall_s = run_command(cmd, Job(name="`snakemake --report`", log_path=log_path, tail_lines=40,
                                  failure_hint=f"command: {' '.join(cmd)}"))  # fmt: skip
    if not html_path.exists():
        raise StageError(f"`snakemake --report` exited with code 0 but wrote no {html_path} (command: {' '.join(cmd)})")
    log.info("report %s (%.1f MB) in %.1f s", html_path, html_path.stat().st_size / 1e6, wall_s)


def summarize_main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        i, o = snakemake.input, snakemake.output
        summarize_run(
            ReportInputs(
                provenance=Path(i.provenance),
                manifest=Path(i.manifest),
                api_compat=Path(i.api_compat),
                canary=Path(i.canary),
                extraction=[Path(p) for p in i.extraction],
                validation=Path(i.validation),
                draft=Path(i.draft),
                acceptance=Path(i.acceptance),
            ),
            ReportOutputs(**{f.name: Path(getattr(o, f.name)) for f in dataclasses.fields(ReportOutputs)}),
        )

    run_stage("summarize_run", snakemake.log[0], body)


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        build_report(
            snakemake.params.snakefile,
            json.loads(snakemake.params.config),
            Path(snakemake.output.html),
            Path(snakemake.params.work_dir),
            snakemake.log[0],
        )

    run_stage("report", snakemake.log[0], body)
