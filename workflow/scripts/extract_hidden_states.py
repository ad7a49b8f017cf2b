"""Snakemake entry for rule `extract_hidden_states`: the work is in eagle3_workflow.extraction."""

from eagle3_workflow.extraction import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
