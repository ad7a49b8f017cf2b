"""Snakemake entry for rule `train_draft`: the work is in eagle3_workflow.training (main in its stage module)."""

from eagle3_workflow.training.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
