# Dataset preparation: conversations -> input_ids + assistant-only loss mask + token frequencies.


rule prepare_data:
    input:
        target=target_dir(),
        sources=data_sources(),
    output:
        prepared=directory(out("data", "prepared")),
        token_freq=out("data", "token_freq.pt"),
        manifest=out("data", "manifest.json"),
    log:
        log_of("prepare_data"),
    conda:
        CONDA_ENV
    resources:
        **gpu_resources(0),
    params:
        formats=data_source_formats(),
        settings=stage_params("prepare_data"),
    script:
        "../scripts/prepare_data.py"
