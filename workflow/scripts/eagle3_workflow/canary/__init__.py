"""Stage `canary`: the production extraction path on a few-layer slice of the real checkpoint, matched slot by slot
against an HF fp32 forward of every layer.

Which module owns what:

- ``check`` the slice (which layers, the truncated checkpoint), the HF reference, the checks and ``run_canary`` (the
  server and the hidden-state client are the production ones: vllm_server, extraction_client)
- ``stage`` ``main(snakemake)``, the rule's adapter
"""
