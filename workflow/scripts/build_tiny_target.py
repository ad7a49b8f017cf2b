"""Snakemake entry for rule `build_tiny_target`: the work is in eagle3_workflow.tiny_target."""

from eagle3_workflow.tiny_target import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
