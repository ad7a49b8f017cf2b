# Evaluation (vLLM serves target + trained / untrained draft) and the report.


rule evaluate_draft:
    input:
        target=target_dir(),
        draft=out("draft"),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
    output:
        report=out("eval", "acceptance.json"),
    params:
        work_dir=out("eval", "work"),
        settings=section_json("evaluate", "vllm"),
    threads: 2
    resources:
        **gpu_resources(config["evaluate"]["gpus"]),
        runtime=lambda wc, attempt: 120 * attempt,
    log:
        log_of("evaluate_draft"),
    script:
        "../scripts/evaluate_draft.py"


rule report:
    input:
        provenance=out("provenance.json"),
        manifest=out("data", "manifest.json"),
        api_compat=out("checks", "api_compat.json"),
        canary=out("checks", "canary.json"),
        extraction=expand(out("hidden_states", "replica_{replica}.json"), replica=REPLICAS),
        validation=out("hidden_states", "validation.json"),
        draft=out("draft"),
        acceptance=out("eval", "acceptance.json"),
    output:
        html=out("report.html"),
    log:
        log_of("report"),
    localrule: True
    script:
        "../scripts/report.py"
