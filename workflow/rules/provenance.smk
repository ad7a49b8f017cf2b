# Provenance of the run: resolved config, package versions, git commit, host, accelerators.


rule record_provenance:
    output:
        out("provenance.json"),
    log:
        log_of("record_provenance"),
    localrule: True
    conda:
        CONDA_ENV
    params:
        config=resolved_config_json(),
        workflow_root=str(WORKFLOW_ROOT),
    script:
        "../scripts/record_provenance.py"
