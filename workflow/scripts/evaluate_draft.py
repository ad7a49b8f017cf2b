"""Snakemake entry for rule `evaluate_draft`: the work is in eagle3_workflow.evaluation.stage."""

from eagle3_workflow.evaluation.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
