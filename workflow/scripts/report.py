"""Snakemake entry for rule `report`: the work is in eagle3_workflow.report.stage."""

from eagle3_workflow.report.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
