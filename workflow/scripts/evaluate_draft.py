"""Snakemake entry for rule `evaluate_draft`: the work is in eagle3_workflow.evaluation."""

from eagle3_workflow.evaluation import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
