"""Snakemake entry for rule `check_target`: the work is in eagle3_workflow.target_check (main in its stage module)."""

from eagle3_workflow.target_check.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
