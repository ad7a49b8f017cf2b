"""Snakemake entry for rule `build_kimi_k25_target`: the work is in eagle3_workflow.target_build (kimi_main in its stage module)."""

from eagle3_workflow.target_build.stage import kimi_main

kimi_main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
