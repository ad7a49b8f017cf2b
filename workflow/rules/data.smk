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
        settings=config_subset(
            "data/max_seq_len",
            "data/overlength",
            "data/on_bad_record",
            "data/min_assistant_tokens",
            "data/max_samples",
            "data/seed",
            "target/trust_remote_code",
        ),
    script:
        "../scripts/prepare_data.py"
