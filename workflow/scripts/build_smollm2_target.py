"""Snakemake entry for rule `build_smollm2_target`: the work is in eagle3_workflow.smollm2."""

from eagle3_workflow.smollm2 import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
