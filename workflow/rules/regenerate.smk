# Self-distillation (optional): the target answers the prompts, and its answers are the training data.
# common.smk's data_sources() points prepare_data at regenerated.jsonl when regenerate.enabled is true.


if config["regenerate"]["enabled"]:

    rule regenerate_responses:
        input:
            target=target_dir(),
            prompt_files=[shipped(p) for p in config["regenerate"]["prompt_files"]],
        output:
            conversations=out("data", "regenerated.jsonl"),
            stats=out("data", "regenerated.stats.json"),
        log:
            log_of("regenerate_responses"),
        conda:
            CONDA_ENV
        threads: 2
        resources:
            **gpu_resources(config["extraction"]["gpus_per_replica"]),
            runtime=lambda wc, attempt: config["regenerate"]["runtime_minutes"] * attempt,
        params:
            settings=section_json("target", "regenerate", "vllm"),
            tensor_parallel_size=config["extraction"]["tensor_parallel_size"],
        script:
            "../scripts/regenerate_responses.py"
