# EAGLE-3 training with speculators. Checkpoints go to train_work/ (not a declared output) so that a rerun
# after a kill resumes from the last one; draft/ holds the final vLLM-loadable checkpoint and metrics.csv.
# train.hidden_states: online adds the trainer's own vLLM server to the job (its GPUs: train_job_gpus).

print(hidden_states_plan(), file=sys.stderr)  # in every plan and run, `snakemake -n` included


rule train_draft:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
        token_freq=out("data", "token_freq.pt"),
        api_compat=out("checks", "api_compat.json"),
        canary=out("checks", "canary.json"),
        # online (train.hidden_states): the validation of the check set extraction wrote
        validation=out("hidden_states", "validation.json"),
    output:
        draft=directory(out("draft")),
    log:
        log_of("train_draft"),
    conda:
        CONDA_ENV
    threads: train_job_threads()
    resources:
        **gpu_resources(train_job_gpus()),
        runtime=lambda wc, attempt: config["train"]["runtime_minutes"] * attempt,
    params:
        files_dir=out("hidden_states", "files"),
        work_dir=out("train_work"),
        settings=stage_params("train_draft"),
    script:
        "../scripts/train_draft.py"
