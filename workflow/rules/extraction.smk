# Hidden-state extraction, one job per replica over disjoint shards of the prepared data (row % replicas).
# Sample files go to hidden_states/files/ which is deliberately NOT a declared output: Snakemake deletes the
# outputs of a failed job, and the files must survive a failure so that the rerun resumes per sample.


wildcard_constraints:
    replica=r"\d+",


rule extract_hidden_states:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
        canary=out("checks", "canary.json"),
    output:
        manifest=out("hidden_states", "replica_{replica}.json"),
    log:
        log_of("extract_hidden_states_replica_{replica}"),
    conda:
        CONDA_ENV
    threads: 2
    resources:
        **gpu_resources(config["extraction"]["gpus_per_replica"]),
        runtime=lambda wc, attempt: config["extraction"]["runtime_minutes"] * attempt,
    params:
        files_dir=out("hidden_states", "files"),
        scratch_dir=lambda wc: out("hidden_states", f"scratch_replica_{wc.replica}"),
        progress=lambda wc: out("hidden_states", f"progress_replica_{wc.replica}.json"),
        settings=stage_params("extract_hidden_states"),
    script:
        "../scripts/extract_hidden_states.py"


rule validate_hidden_states:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
        manifests=expand(out("hidden_states", "replica_{replica}.json"), replica=REPLICAS),
    output:
        report=out("hidden_states", "validation.json"),
    log:
        log_of("validate_hidden_states"),
    conda:
        CONDA_ENV
    # the full-depth check runs an fp32 forward of the whole target, on CPU (threads help a large one; locally
    # Snakemake caps them at --cores) or, with reference.device: cuda, on one GPU
    threads: 8
    resources:
        **gpu_resources(reference_gpus()),
    params:
        files_dir=out("hidden_states", "files"),
        settings=stage_params("validate_hidden_states"),
    script:
        "../scripts/validate_hidden_states.py"
