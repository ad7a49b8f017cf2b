"""Stage `validate_hidden_states`: every hidden-state file is checked before training may read it.

Which module owns what:

- ``checks``     every file (keys, shape, dtype, finite, token ids) and the greedy cross-check through the target's
  final norm and lm_head
- ``full_depth`` every captured id of two samples against the whole target's fp32 reference (streamed by
  full_depth_reference, shared with check_api's preflight)
- ``stage``      ``main(snakemake)``, the rule's adapter
"""
