# The target model: built locally for the self-contained presets (no model hub is needed): tiny, smollm2, or
# the Kimi-K2.5 stand-in (kimi_k25).


if target_build_kind() == "tiny":

    rule build_tiny_target:
        input:
            corpus=[shipped(s["path"]) for s in config["data"]["sources"]]
            + [shipped("config/data/seed_prompts.txt")],
        output:
            target=directory(out("target")),
        log:
            log_of("build_tiny_target"),
        conda:
            CONDA_ENV
        params:
            settings=stage_params("build_tiny_target"),
        script:
            "../scripts/build_tiny_target.py"


if target_build_kind() == "smollm2":

    rule build_smollm2_target:
        input:
            gguf=smollm2_gguf(),
        output:
            target=directory(out("target")),
        log:
            log_of("build_smollm2_target"),
        conda:
            CONDA_ENV
        threads: 2
        resources:
            **gpu_resources(0),
            runtime=lambda wc, attempt: 30 * attempt,
        params:
            settings=stage_params("build_smollm2_target"),
        script:
            "../scripts/build_smollm2_target.py"


if target_build_kind() == "kimi_k25":

    rule build_kimi_k25_target:
        input:
            corpus=[shipped(s["path"]) for s in config["data"]["sources"]]
            + [shipped("config/data/seed_prompts.txt")],
        output:
            target=directory(out("target")),
        log:
            log_of("build_kimi_k25_target"),
        conda:
            CONDA_ENV
        params:
            settings=stage_params("build_kimi_k25_target"),
        script:
            "../scripts/build_kimi_k25_target.py"
