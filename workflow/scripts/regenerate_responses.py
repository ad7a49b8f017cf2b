"""Snakemake entry for rule `regenerate_responses`: the work is in eagle3_workflow.regenerate.stage."""

from eagle3_workflow.regenerate.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
