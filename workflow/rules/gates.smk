# The gates. check_api proves every surface the workflow touches exists with the expected signature; the
# canary runs the production extraction path on a few-layer slice of the real checkpoint and compares it
# with an independent HF forward. Extraction takes both artefacts as input.


rule check_api:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
    output:
        report=out("checks", "api_compat.json"),
    params:
        settings=section_json("target", "hidden_states", "check_api", "vllm"),
    log:
        log_of("check_api"),
    script:
        "../scripts/check_api.py"


rule canary:
    input:
        target=target_dir(),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
    output:
        report=out("checks", "canary.json"),
    params:
        work_dir=out("checks", "canary_work"),
        settings=section_json("target", "hidden_states", "canary", "vllm"),
        tensor_parallel_size=config["extraction"]["tensor_parallel_size"],
    threads: 2
    resources:
        **gpu_resources(config["extraction"]["gpus_per_replica"]),
        runtime=lambda wc, attempt: 60 * attempt,
    log:
        log_of("canary"),
    script:
        "../scripts/canary.py"
