"""Snakemake entry for rule `prepare_data`: the work is in eagle3_workflow.prepare (main in its stage module)."""

from eagle3_workflow.prepare.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
