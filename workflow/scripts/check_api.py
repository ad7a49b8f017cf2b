"""Snakemake entry for rule `check_api`: the work is in eagle3_workflow.api_checks (main in its stage module)."""

from eagle3_workflow.api_checks.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
