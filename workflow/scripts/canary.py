"""Snakemake entry for rule `canary`: the work is in eagle3_workflow.canary (main in its stage module)."""

from eagle3_workflow.canary.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
