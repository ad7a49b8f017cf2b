"""Snakemake entry for rule `validate_hidden_states`: the work is in eagle3_workflow.validation."""

from eagle3_workflow.validation import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
