"""Stage `train_draft`: an EAGLE-3 draft trained by speculators' own trainer, resumable after a kill.

Which module owns what:

- the trainer's command line from the ``train`` settings lives in the shared ``trainer.command`` (check_api checks
  its flags against the installed speculators);
- ``workdir``: the resumable ``train_work/``: fingerprint, data links, vocab mapping, launch files;
- ``checkpoints``: which saved state is the newest complete one (``interrupted/`` included), putting it where
  speculators resumes from, and the stop line's sentence saying what the rerun will do;
- ``checkpoint_space``: the refusal before training when the file system cannot hold the epochs still to be saved
  (their bytes: trainer.checkpoint_size), and the
  "disk full" cause of a trainer that died on a failed write (issue #41);
- ``launcher``: one launch of the trainer through ``runtime.ChildProcess`` (torchrun on several GPUs), and what its
  exit means;
- ``metrics``: the launches' metric records -> metrics.csv and the final losses (pure);
- ``publish``: draft/ (final checkpoint, metrics.csv, training.json), verified, all or nothing;
- ``online``: train.hidden_states: online, the stage's side: the trainer's own vLLM server for each launch, the
  job's GPUs split between server and trainer, the watch that ends training when the server dies (the trainer's
  side, every sample checked as it arrives and the failure policy: ``trainer.online_samples``);
- ``stage``: ``train_draft`` (the steps in order) and ``main(snakemake)``, the rule's adapter.

Layout of ``train_work/`` (kept across failures; Snakemake deletes only the declared ``draft/``):

- ``data/``: the data directory ``speculators train`` reads: symlinks to the prepared dataset's files,
  ``token_freq.pt`` and ``hidden_states -> <files_dir>`` (offline only: online the trainer finds no sample on disk
  and generates each), plus the vocabulary mapping
  ``d2t-<size>.npy`` / ``t2d-<size>.npy`` (built once from the token frequencies, then only ever read);
- ``checkpoints/<epoch>/``: speculators' checkpoints (end of an epoch, or inside it with ``checkpoint_freq`` < 1),
  and ``checkpoints/interrupted/``, its save on SIGTERM/SIGINT (with the epoch and step the trainer entry records
  there, ``trainer.interrupt``); a rerun resumes from whichever holds the most steps;
- ``logs/trainer-attempt-<n>.log``: the trainer's full output, one file per launch;
- ``logs/metrics-attempt-<n>.jsonl``: the metric records of that launch, one JSON line each, written by the
  trainer's rank 0 (metrics.csv is built from these, so the steps of a killed attempt are not lost);
- ``online/`` (online only): ``hidden_states/`` where the server writes each sample until the trainer loaded it
  (emptied before each launch), ``vllm_server.log``, ``counts/`` (samples checked per trainer process and split),
  ``failed_samples.jsonl`` (samples that still failed after the retries);
- ``fingerprint.json``: what the checkpoints were trained from. When an input changes, the checkpoints and the
  mapping belong to another run: the directory is cleared and training starts afresh (logged).

The trainer runs as a subprocess: ``python -m eagle3_workflow.trainer.entry`` (CPU or one GPU) or
``torch.distributed.run ... -m eagle3_workflow.trainer.entry`` (several GPUs). The entry runs speculators' own
``speculators train`` with a handler on its metric logger (``speculators.metrics``) that writes each metric
dict as a JSON line, with ``trainer.interrupt``'s patches (a resumable interrupt save), and on CPU with the CPU
shim's patches; the records are the same on every device.
"""
