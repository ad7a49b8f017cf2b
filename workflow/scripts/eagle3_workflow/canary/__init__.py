"""Stage `canary`: the production extraction path on a few-layer slice of the real checkpoint, matched slot by slot
against an HF fp32 forward of every layer.

Which module owns what:

- ``slice`` which layers the slice keeps, the ids captured from it, the truncated checkpoint
- ``check`` the HF reference of every layer, the checks and ``run_canary`` (the server and the hidden-state client
  are the production ones: vllm_server, extraction_client)
- ``stage`` ``main(snakemake)``, the rule's adapter
"""
