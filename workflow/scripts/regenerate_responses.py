"""Snakemake entry for rule `regenerate_responses`: the work is in eagle3_workflow.regenerate."""

from eagle3_workflow.regenerate import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
