"""Snakemake entry for rule `summarize_run`: the work is in eagle3_workflow.report."""

from eagle3_workflow.report import summarize_main

summarize_main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
