"""Stage `regenerate_responses` (self-distillation): the target answers the prompts itself.

Which module owns what:

- ``prompts``  prompt files, conversations and their answer slots, deduplication, turn-by-turn answering (pure)
- ``magpie``   Magpie user turns written by the target from its chat template's user prefix (pure)
- ``protocol`` RegenerationSpec, what the stage hands the worker (the worker's result is the stats artefact)
- ``generate`` the engine worker, ``python -m eagle3_workflow.regenerate.generate``: offline vLLM, the
  regeneration pipeline and its stats, the atomic outputs (vLLM imported only inside functions)
- ``stage``    the parent: runs the worker through runtime.worker; ``main(snakemake)`` is the rule's adapter
"""
