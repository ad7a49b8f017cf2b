# The gated EAGLE-3 workflow: prepare -> check_api -> canary -> extract -> validate -> train -> evaluate -> report.
# Each stage's artefact is the next stage's input, so a broken forward stops at the canary, not after a long
# load on 8 GPUs. Rules live in workflow/rules/, one file per stage; config keys are explained in
# config/README.md. Without --configfile the tiny preset runs (config/config.yaml, loaded in common.smk).


include: "workflow/rules/common.smk"
include: "workflow/rules/provenance.smk"
include: "workflow/rules/target.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/regenerate.smk"
include: "workflow/rules/gates.smk"
include: "workflow/rules/extraction.smk"
include: "workflow/rules/training.smk"
include: "workflow/rules/evaluation.smk"
include: "workflow/rules/publish.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
        out("published_draft"),
