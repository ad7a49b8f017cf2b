"""Stage `check_api`: every vLLM / speculators / transformers surface the workflow touches, checked before any model
is loaded.

Which module owns what:

- ``checks`` ``run_api_checks`` (every check as a row: name, expected, found, pass), the checks of speculators, the
  target and the references, and the advice for failed rows
- ``vllm_surfaces`` the checks of vLLM's surfaces (version, method, connector, CPU internals, architectures, metrics)
- ``stage``  ``main(snakemake)``, the rule's adapter
"""
