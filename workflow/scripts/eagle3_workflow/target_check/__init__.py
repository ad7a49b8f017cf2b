"""Stage `check_target`: the target answers a few fixed questions through its chat template, greedily.

Which module owns what:

- ``sanity`` the questions, the judge of an answer, ``check_target`` (a vLLM server of the target)
- ``stage``  ``main(snakemake)``, the rule's adapter
"""
