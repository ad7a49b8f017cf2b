"""Snakemake entry for rule `build_tiny_target`: the work is in eagle3_workflow.target_build (tiny_main in its stage module)."""

from eagle3_workflow.target_build.stage import tiny_main

tiny_main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
