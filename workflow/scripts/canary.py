"""Snakemake entry for rule `canary`: the work is in eagle3_workflow.canary."""

from eagle3_workflow.canary import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
