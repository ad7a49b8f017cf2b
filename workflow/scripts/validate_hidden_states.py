"""Snakemake entry for rule `validate_hidden_states`: the work is in eagle3_workflow.validation (main in its stage module)."""

from eagle3_workflow.validation.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
