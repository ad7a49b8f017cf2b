"""Stages `build_smollm2_target`, `build_tiny_target` and `build_kimi_k25_target`: their rules' adapters,
``smollm2_main(snakemake)``, ``tiny_main(snakemake)`` and ``kimi_main(snakemake)``: the target built (smollm2.py,
tiny.py, kimi.py) into the rule's target/ folder."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from eagle3_workflow.target_build.kimi import build_kimi_k25_target
from eagle3_workflow.target_build.smollm2 import build_smollm2_target
from eagle3_workflow.target_build.tiny import build_tiny_target


def smollm2_main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.settings.stages import BuildSmollm2TargetStage
    from eagle3_workflow.settings.views import stage_settings

    def body(log: logging.Logger) -> None:
        out_dir = Path(snakemake.output.target)
        dtype = stage_settings(BuildSmollm2TargetStage, snakemake.params.settings).target.dtype
        try:
            record = build_smollm2_target(out_dir, gguf_path=Path(snakemake.input.gguf), dtype=dtype)
        except BaseException:
            # a half-written model directory must not look like a target to a later, manual run
            shutil.rmtree(out_dir, ignore_errors=True)
            raise
        log.info(
            "SmolLM2 target: %d layers, hidden %d, vocab %d, tied embeddings %s, %d tensors within %.2g of the "
            "GGUF; convert %.1f s, verify %.1f s",
            record.num_layers,
            record.hidden_size,
            record.vocab_size,
            record.tie_word_embeddings,
            record.tensors_checked,
            record.max_relative_weight_error,
            record.convert_s,
            record.verify_s,
        )

    run_stage("build_smollm2_target", snakemake.log[0], body)


def tiny_main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.settings.stages import BuildTinyTargetStage
    from eagle3_workflow.settings.views import stage_settings

    def body(log: logging.Logger) -> None:
        settings = stage_settings(BuildTinyTargetStage, snakemake.params.settings)
        build_tiny_target(
            Path(snakemake.output.target), [Path(p) for p in snakemake.input.corpus], settings.target.build
        )

    run_stage("build_tiny_target", snakemake.log[0], body)


def kimi_main(snakemake: Any) -> None:
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.settings.stages import BuildKimiK25TargetStage
    from eagle3_workflow.settings.views import stage_settings

    def body(log: logging.Logger) -> None:
        out_dir = Path(snakemake.output.target)
        settings = stage_settings(BuildKimiK25TargetStage, snakemake.params.settings)
        import torch

        # drawn on the GPU where there is one: the real-width stand-in (tens of GB) in minutes (docs/gpu.md)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            build_kimi_k25_target(
                out_dir, [Path(p) for p in snakemake.input.corpus], settings.target.build, device=device
            )
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)  # a half-written checkpoint must not look like a target
            raise

    run_stage("build_kimi_k25_target", snakemake.log[0], body)
