"""Snakemake entry for rule `build_smollm2_target`: the work is in eagle3_workflow.target_build (smollm2_main in its stage
module)."""

from eagle3_workflow.target_build.stage import smollm2_main

smollm2_main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
