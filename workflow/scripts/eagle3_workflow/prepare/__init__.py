"""Stage `prepare_data`: conversations read, chat template applied, assistant-only loss mask, length filter.

Which module owns what:

- ``conversations`` the readers and the bad-record table, the loss mask by render-and-diff, token frequencies, the
  prepared dataset and data/manifest.json
- ``stage``         ``main(snakemake)``, the rule's adapter
"""
