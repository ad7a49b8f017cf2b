# Evaluation (vLLM serves target + trained / untrained draft) and the report.
#
# The report is a real Snakemake report: `summarize_run` writes figures and tables flagged with report() (captions
# in workflow/report/), and `report` runs `snakemake --report` on this same workflow to bundle them, with the
# rule graph, runtimes and provenance, into one self-contained report.html. It is two rules because Snakemake's
# report refuses outputs of a job that is still running (it marks them incomplete); see eagle3_workflow.report.stage.


report: "../report/workflow.rst"


rule evaluate_draft:
    input:
        target=target_dir(),
        draft=out("draft"),
        prepared=out("data", "prepared"),
        api_compat=out("checks", "api_compat.json"),
        # an input when used, so that editing the prompt file reruns the evaluation
        prompt_file=(
            [shipped(config["evaluate"]["prompt_file"])]
            if config["evaluate"]["prompts"] == "file"
            else []
        ),
    output:
        report=out("eval", "acceptance.json"),
    log:
        log_of("evaluate_draft"),
    conda:
        CONDA_ENV
    threads: 2
    resources:
        **gpu_resources(config["evaluate"]["gpus"]),
        runtime=lambda wc, attempt: 120 * attempt,
    params:
        work_dir=out("eval", "work"),
        settings=stage_params("evaluate_draft"),
    script:
        "../scripts/evaluate_draft.py"


rule summarize_run:
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
        summary=report(
            out("report", "summary.html"), caption="../report/summary.rst", category="1. Summary"
        ),
        data=report(out("report", "data.svg"), caption="../report/data.rst", category="2. Data"),
        data_table=report(
            out("report", "data.html"), caption="../report/data.rst", category="2. Data"
        ),
        gates=report(
            out("report", "gates.html"), caption="../report/gates.rst", category="3. Gates"
        ),
        extraction=report(
            out("report", "extraction.svg"),
            caption="../report/extraction.rst",
            category="4. Extraction",
        ),
        extraction_table=report(
            out("report", "extraction.html"),
            caption="../report/extraction.rst",
            category="4. Extraction",
        ),
        training=report(
            out("report", "training.svg"), caption="../report/training.rst", category="5. Training"
        ),
        acceptance=report(
            out("report", "acceptance.svg"),
            caption="../report/acceptance.rst",
            category="6. Evaluation",
        ),
        acceptance_table=report(
            out("report", "acceptance.html"),
            caption="../report/acceptance.rst",
            category="6. Evaluation",
        ),
        provenance=report(
            out("report", "provenance.html"),
            caption="../report/provenance.rst",
            category="7. Provenance",
        ),
    log:
        log_of("summarize_run"),
    localrule: True
    conda:
        CONDA_ENV
    script:
        "../scripts/summarize_run.py"


rule report:
    input:
        rules.summarize_run.output,
    output:
        html=out("report.html"),
    log:
        log_of("report"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        snakefile=workflow.main_snakefile,
        config=resolved_config_json(),
        work_dir=out("report", "work"),
    script:
        "../scripts/report.py"
