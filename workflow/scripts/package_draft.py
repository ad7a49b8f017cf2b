"""Snakemake entry for rule `package_draft`: the work is in eagle3_workflow.model_card (main in its stage module)."""

from eagle3_workflow.model_card.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
