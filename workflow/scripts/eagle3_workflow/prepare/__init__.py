"""Stage `prepare_data`: conversations read, chat template applied, assistant-only loss mask, length and repetition
filters.

Which module owns what:

- ``conversations`` the readers and the bad-record table, the loss mask by render-and-diff, token frequencies, the
  prepared dataset and data/manifest.json
- ``repetition``  how much an answer repeats itself (``data.max_repeated_share``; stdlib only: bench/gpu/cut_answers.py
  reads restore bundles with it)
- ``stage``         ``main(snakemake)``, the rule's adapter
"""
