# The target model: built locally for the self-contained presets (no model hub is needed).


if target_build_kind() == "tiny":

    rule build_tiny_target:
        input:
            corpus=[shipped(s["path"]) for s in config["data"]["sources"]]
            + [shipped("config/data/seed_prompts.txt")],
        output:
            target=directory(out("target")),
        params:
            build=section_json("target"),
        log:
            log_of("build_tiny_target"),
        script:
            "../scripts/build_tiny_target.py"


if target_build_kind() == "smollm2":

    rule build_smollm2_target:
        output:
            target=directory(out("target")),
        log:
            log_of("build_smollm2_target"),
        script:
            "../scripts/build_smollm2_target.py"
