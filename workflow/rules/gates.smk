# The gates. check_api proves every surface the workflow touches exists with the expected signature; the
# canary runs the production extraction path on a few-layer slice of the real checkpoint and compares it
# with an independent HF forward. Extraction takes both artefacts as input.


rule check_api:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
    output:
        report=out("checks", "api_compat.json"),
    log:
        log_of("check_api"),
    conda:
        CONDA_ENV
    resources:
        **gpu_resources(0),
    params:
        settings=stage_params("check_api"),
    script:
        "../scripts/check_api.py"


rule canary:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
    output:
        report=out("checks", "canary.json"),
    log:
        log_of("canary"),
    conda:
        CONDA_ENV
    threads: 2
    resources:
        **gpu_resources(config["extraction"]["gpus_per_replica"]),
        runtime=lambda wc, attempt: 60 * attempt,
    params:
        work_dir=out("checks", "canary_work"),
        settings=stage_params("canary"),
    script:
        "../scripts/canary.py"
