"""speculators' trainer process: how train_draft starts it and what the workflow runs inside it.

Owns:
- ``command``: the trainer's command line (speculators' own flags, torchrun for several ranks) and its device;
- ``entry``: the entry of every trainer process (``python -m eagle3_workflow.trainer.entry``): the metrics handler,
  and by environment the patches below;
- ``interrupt``: a stop signal saves ``checkpoints/interrupted`` with the epoch and step it holds;
- ``cpu_shim``: device placement on a machine with no accelerator;
- ``online_samples``: the dataset of train.hidden_states: online, checking each sample a vLLM server generates;
- ``checkpoint_size``: the bytes of the checkpoints it writes (the draft it builds, in bf16, with the optimizer's
  state; which epochs save one), from the target's config.json alone;
- ``online_spec``: what the stage and the trainer's dataset share (the spec, its environment variables, the
  failures file and the counts), free of speculators so that the stage can import it cheaply.

May import: runtime, files, settings (docs/architecture.md). Not serving or reference: the trainer talks to vLLM
only through speculators' own client. Imported by the training, api_checks and forecast stages.
"""
