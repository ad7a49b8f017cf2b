# Dataset preparation: conversations -> input_ids + assistant-only loss mask + token frequencies.


rule prepare_data:
    input:
        target=target_dir(),
        sources=data_sources(),
    output:
        prepared=directory(out("data", "prepared")),
        token_freq=out("data", "token_freq.pt"),
        manifest=out("data", "manifest.json"),
    params:
        formats=data_source_formats(),
        data=section_json("data"),
    log:
        log_of("prepare_data"),
    script:
        "../scripts/prepare_data.py"
