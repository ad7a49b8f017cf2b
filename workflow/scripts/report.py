"""Snakemake entry for rule `report`: the work is in eagle3_workflow.report."""

from eagle3_workflow.report import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
