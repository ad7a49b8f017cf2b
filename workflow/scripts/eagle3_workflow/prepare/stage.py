"""Stage `prepare_data`: ``main(snakemake)``, the rule's adapter: the sources through prepare_conversations
(conversations.py), the prepared dataset, token frequencies and data/manifest.json written."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import write
from eagle3_workflow.files.chat import load_chat_tokenizer
from eagle3_workflow.prepare.conversations import (
    MAX_REPORTED_BAD,
    build_manifest,
    prepare_conversations,
    write_prepared,
)
from eagle3_workflow.settings.stages import PrepareDataStage
from eagle3_workflow.settings.views import stage_settings


def main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage

    def body(log: logging.Logger) -> None:
        settings = stage_settings(PrepareDataStage, snakemake.params.settings)
        tokenizer = load_chat_tokenizer(snakemake.input.target, trust_remote_code=settings.target.trust_remote_code)
        sources = [(Path(p), fmt) for p, fmt in zip(snakemake.input.sources, snakemake.params.formats, strict=True)]
        result = prepare_conversations(sources, tokenizer, settings.data)
        prepared_dir = Path(snakemake.output.prepared)
        token_freq_path = Path(snakemake.output.token_freq)
        write_prepared(result, prepared_dir, token_freq_path)
        manifest = build_manifest(
            result, [str(p) for p, _ in sources], settings.data.max_seq_len, prepared_dir, token_freq_path
        )
        for b in result.bad_records[:MAX_REPORTED_BAD]:
            log.warning("skipped %s: %s (%s)", b.where(), b.reason, b.detail)
        log.info(
            "kept %d of %d records; dropped %s; %d tokens (%d assistant)",
            manifest.records_kept,
            manifest.records_read,
            manifest.dropped,
            manifest.total_tokens,
            manifest.assistant_tokens,
        )
        write(snakemake.output.manifest, manifest)

    run_stage("prepare_data", snakemake.log[0], body)
