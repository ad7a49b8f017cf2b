"""Stage `record_provenance`: the run's resolved config, package versions, git commit, host and accelerators.

Which module owns what:

- ``collect`` what provenance.json records
- ``stage``   ``main(snakemake)``, the rule's adapter
"""
