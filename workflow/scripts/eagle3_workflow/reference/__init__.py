"""The independent reference every proof rests on: the target read from its own files, never through vLLM.

Owns:
- ``target_config``: the target checkpoint on disk (its config.json as a typed view, which safetensors file holds
  each tensor, reading tensors);
- ``compressed_weights``: compressed-tensors checkpoints (Kimi-K2.5's int4 experts) read as fp32 weights, with the
  library's own decompression;
- ``full_depth``: the fp32 forward of the whole target streamed one decoder layer at a time (check_api's preflight,
  validate_hidden_states' full-depth check, the evaluation's draft parity);
- ``layer_match``: which reference layer each captured slot came from, and the MoE routing-flip rule.

May import: files, settings (docs/architecture.md); torch, transformers, safetensors, compressed_tensors. Not
runtime, serving or trainer: a reference that started a process or asked vLLM would not be independent.
"""
