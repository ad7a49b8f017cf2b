"""Snakemake entry for rule `record_provenance`: the work is in eagle3_workflow.provenance."""

from eagle3_workflow.provenance import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
