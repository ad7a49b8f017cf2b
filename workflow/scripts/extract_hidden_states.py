"""Snakemake entry for rule `extract_hidden_states`: the work is in eagle3_workflow.extraction (main in its stage module)."""

from eagle3_workflow.extraction.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
