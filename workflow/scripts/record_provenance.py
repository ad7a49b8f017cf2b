"""Snakemake entry for rule `record_provenance`: the work is in eagle3_workflow.provenance (main in its stage module)."""

from eagle3_workflow.provenance.stage import main

main(snakemake)  # noqa: F821 - injected by Snakemake's script directive
