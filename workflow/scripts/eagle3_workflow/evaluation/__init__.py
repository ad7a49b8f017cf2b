"""Stage `evaluate_draft`: vLLM runs the target with the trained EAGLE-3 draft, and with an untrained draft of the
same shape as the baseline; acceptance from vLLM's own spec-decode counters, tokens/s with and without
speculation, and a lossless check (greedy output with speculation == greedy output without).

Which module owns what, in the stage's order: plan, run, judge (pure modules import no vllm, torch or subprocess
at module level):
- ``stage``     evaluate_draft (the three steps in order, and the StageError of a failed check) and the Snakemake
  adapter ``main(snakemake)``.
- ``plan``      planning the measurements: which engines run in which processes with which kernels, the lossless
  numerics and reference, at once or one after another, each engine's GPU memory, the processes' environment.
- ``measurements``  running them: the planned processes, the first one started early, the untrained reference's
  extra process; Measured, what they returned.
- ``resume``    each engine's key and result file, and reusing what an earlier attempt measured with the same key
  (pure).
- ``judge``     judging them: the lossless verdict, each draft's results, train/serve consistency, draft parity, the
  report and its notes.
- ``prompts``   the prompt sets (heldout, humaneval, file), rendered with the chat template to token ids (pure).
- ``metrics``   acceptance from the spec-decode counters, one run's AcceptanceResult, the summary table (pure).
- ``lossless``  the greedy comparison, its first divergences and the failure message with their table (pure).
- ``consistency``  train/serve consistency: served per-position acceptance against what the draft's own validation
  accuracy (speculators' full_acc_k) predicts, its verdict and failure message (pure).
- ``parity``    draft parity: each served step judged against the trained draft's prediction, the rounding bound
  of a tie, the served files against the trainer's checkpoint, the failure message.
- ``parity_reference``  parity's reference: speculators' draft from the trainer's checkpoint, run in fp32 on the
  fp32 reference's hidden states of the target (torch and speculators inside its functions).
- ``baseline``  the untrained draft (torch, speculators), built once per recipe (recipe.json beside it) and kept
  across attempts, so the keys of its measured engines hold.
- ``fingerprint``  what identifies a model folder's bytes: content up to 1 GiB, else size:mtime (pure).
- ``protocol``  spec.json / result.json exchanged with the measurement process (files/artefacts.py models, pure).
- ``launch``    the stage's side of a measurement process: engine kwargs, environment, its runtime.worker Job.
- ``gate``      the lock file that measurement processes running at once share: each timing pass alone (pure).
- ``measure``   the measurement process itself (a runtime.worker), the stage's only ``-m`` entry; the only module
  importing vLLM.
Imports run one way: stage -> judge -> measurements -> plan and resume; none of these imports one above it.
Its settings are eagle3_workflow.settings.stages.EvaluateDraftStage (the `evaluate` section as EvaluationSettings).

Measurement. Each engine first generates a few tokens (warm-up, excluded); the spec-decode counters are read
before and after the measured pass and subtracted. Greedy decoding (temperature 0), the top-5 logprobs of every
generated token are requested in every run (same overhead for all), prefix caching is off (every run does the same
work). Mean acceptance length = 1 + accepted / drafts (tokens per verification step including the bonus token);
per-position acceptance = accepted at draft position i / drafts.

Lossless check. The first token where a speculative run differs from the reference, per prompt. A mismatch fails
the stage unless the reference's logprob of the token it chose exceeds that of the speculative run's token by at
most ``evaluate.lossless_logprob_tolerance`` (default 0: only exact ties pass). Batched bf16 on GPU can flip
near-ties; the artefact records the gap of every mismatch so a person can judge.

Train/serve consistency. The trained draft's served position-0 acceptance must be at least
``evaluate.consistency_min_ratio`` x its final validation full_acc_0 (draft/training.json); the derivation and
the numbers of real runs are in ``consistency``. A collapse fails the stage with the likely causes.

This file imports nothing: ``python -m eagle3_workflow.evaluation.measure`` imports the package first, and the
measurement process should load only what it runs.
"""
