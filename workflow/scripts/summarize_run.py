"""Snakemake entry for rule `summarize_run`: the work is in eagle3_workflow.report.stage."""

from eagle3_workflow.report.stage import summarize_main

summarize_main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
