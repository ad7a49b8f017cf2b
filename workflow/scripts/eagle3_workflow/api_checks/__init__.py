"""Stage `check_api`: every vLLM / speculators / transformers surface the workflow touches, checked before any model
is loaded.

Which module owns what:

- ``checks`` every check as a row (name, expected, found, pass), ``run_api_checks`` (the table) and the advice for
  failed rows
- ``stage``  ``main(snakemake)``, the rule's adapter
"""
