"""Snakemake entry for rule `prepare_data`: the work is in eagle3_workflow.prepare."""

from eagle3_workflow.prepare import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
