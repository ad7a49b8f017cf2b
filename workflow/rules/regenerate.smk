# Self-distillation (optional): the target answers the prompts, and its answers are the training data.
# common.smk's data_sources() points prepare_data at regenerated.jsonl when regenerate.enabled is true.
# check_target gates it: a target that does not answer through its chat template writes no training data.


if config["regenerate"]["enabled"]:

    # The target must answer its chat template (not a base model, not a broken template) before its answers
    # become the training data. Skippable: target_check.enabled.
    rule check_target:
        input:
            target=target_dir(),
        output:
            report=out("checks", "target_sanity.json"),
        log:
            log_of("check_target"),
        conda:
            CONDA_ENV
        threads: 2
        resources:
            **gpu_resources(config["extraction"]["gpus_per_replica"]),
            runtime=lambda wc, attempt: 60 * attempt,
        params:
            settings=stage_params("check_target"),
        script:
            "../scripts/check_target.py"

    rule regenerate_responses:
        input:
            target=target_dir(),
            prompt_files=[shipped(p) for p in config["regenerate"]["prompt_files"]],
            target_sanity=(
                [out("checks", "target_sanity.json")] if config["target_check"]["enabled"] else []
            ),
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
            settings=stage_params("regenerate_responses"),
        script:
            "../scripts/regenerate_responses.py"
