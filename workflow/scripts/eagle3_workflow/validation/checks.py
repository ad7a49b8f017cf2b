"""Stage `validate_hidden_states`: every sample file is checked before training may read it.

Checks per file: keys, shape [T, L, H] with the captured L and the target's H, float dtype, finite,
non-constant, token_ids equal to the prepared input_ids. Missing or bad samples above
validation.max_bad_samples (default 0) fail the stage with a table of what is wrong.

Cross-check on the full model: for the few samples whose greedy next token the extraction server reported
(replica manifests, `greedy_probes`), the captured last state (id N, last position) goes through the target's
final norm and lm_head (read lazily from its safetensors, fp32) and must give that token. The slice-based
canary cannot see a capture that drifts only on the full model; this can, for id N.

Full-depth proof (full_depth.py, `validation.full_depth_check`): EVERY captured id of the longest and the shortest
sample against an fp32 reference of the whole target, streamed one decoder layer at a time; each id must be nearest
to its own layer and within tolerance, or the stage fails naming every wrong id. Turned off, the report says so
(unsafe).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_workflow.files.data_artefacts import GreedyCheck, GreedyProbe, ValidationReport
from eagle3_workflow.files.hidden_states import HiddenStateFiles, read_hidden_states
from eagle3_workflow.files.target_weights import weight_files
from eagle3_workflow.reference.target_config import read_target_config, read_tensors, text_weight_prefix
from eagle3_workflow.settings.errors import StageError, render_table

MAX_LISTED = 50
# Final norms this check knows: plain RMSNorm x * rsqrt(mean(x^2) + eps) * w. Gemma's (1 + w) and logit
# soft-capping, or any other head, are refused by name rather than checked with the wrong formula.
# kimi_k2: Kimi-K2/K2.5's language model, DeepSeek-V3's architecture (transformers reads it as DeepseekV3Config).
RMSNORM_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2"}
# bf16 has an 8-bit significand: the server's bf16 logits cannot order two tokens closer than a couple of ulps
# (2^-7 relative each). A token within 2^-6 x the largest |logit| of our fp32 argmax counts as a tie.
TIE_RELATIVE = 2.0**-6


def load_final_head(target_dir: Path) -> tuple[Any, Any, float]:
    """(final norm weight, lm_head weight [V, H], eps) of the target, read lazily from its safetensors."""
    config = read_target_config(target_dir)
    model_type = str(config.decoder_model_type)
    if model_type not in RMSNORM_MODEL_TYPES:
        raise StageError(
            f"the greedy-token cross-check does not know the final norm of model_type {model_type!r} (it knows "
            f"{sorted(RMSNORM_MODEL_TYPES)}); set extraction.greedy_probe_samples: 0 to skip it for this target"
        )
    files = weight_files(target_dir)
    prefix = text_weight_prefix(files)  # "language_model." in a multimodal wrapper's checkpoint (Kimi-K2.5)
    norm = prefix + "model.norm.weight"
    head = prefix + ("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    for name in (norm, head):
        if name not in files:
            raise StageError(
                f"the safetensors of {target_dir} hold no tensor {name!r}; cannot cross-check the last state"
            )
    tensors = read_tensors(target_dir, files, [norm, head])
    return tensors[norm].float(), tensors[head].float(), float(config.text.get("rms_norm_eps", 1e-6))


def greedy_check_row(last_state: Any, probe: GreedyProbe, norm: Any, head: Any, eps: float) -> GreedyCheck:
    """Recompute the next token from one captured last state; ok when it is the server's or a bf16 tie."""
    import torch

    state = last_state.float()
    normed = state * torch.rsqrt(state.pow(2).mean() + eps) * norm
    logits = head @ normed
    ours = int(logits.argmax())
    server = probe.token_id
    gap = float(logits[ours] - logits[server])
    tolerance = TIE_RELATIVE * float(logits.abs().max())
    return GreedyCheck(
        row=probe.row,
        server_token=server,
        recomputed_token=ours,
        logit_gap=round(gap, 4),
        tolerance=round(tolerance, 4),
        ok=gap <= tolerance,
    )


def greedy_cross_check(target_dir: Path, files_dir: Path, probes: list[GreedyProbe]) -> list[GreedyCheck]:
    if not probes:
        return []
    norm, head, eps = load_final_head(target_dir)
    rows = []
    for probe in probes:
        last_state = read_hidden_states(files_dir, probe.row, slice(-1, None))[0, -1]  # last position, id N
        rows.append(greedy_check_row(last_state, probe, norm, head, eps))
    return rows


def greedy_failure_message(rows: list[GreedyCheck]) -> str:
    table = render_table(
        ["row", "server token", "from captured id N", "logit gap", "tolerance"],
        [(r.row, r.server_token, r.recomputed_token, r.logit_gap, r.tolerance) for r in rows if not r.ok],
    )
    return (
        f"{sum(not r.ok for r in rows)} of {len(rows)} samples: the captured last state (id N) through the "
        f"target's final norm and lm_head does not give the server's own greedy next token:\n{table}\n"
        "The last captured layer is not the pre-norm output of the last decoder layer (a layer-id remap or a "
        "post-norm capture in this vLLM build). The hidden states are unusable for training; do not raise "
        "tolerances. Check the vLLM version against envs/ and rerun the canary."
    )


def validate_files(
    input_ids: list[list[int]], files: HiddenStateFiles, *, max_bad_samples: int, rows: list[int] | None = None
) -> ValidationReport:
    """Every prepared row's file in `files` checked in full (row = its index in `input_ids`), or only `rows` (online
    training's check set)."""
    missing: list[int] = []
    bad: dict[str, str] = {}
    tokens = size = valid = 0
    checked = list(range(len(input_ids))) if rows is None else rows
    for row in checked:
        ids = input_ids[row]
        path = files.path(row)
        reason = files.check(path, ids, full=True)
        if reason == "missing":
            missing.append(row)
        elif reason is not None:
            bad[str(row)] = reason
        else:
            valid += 1
            tokens += len(ids)
            size += path.stat().st_size
    failures = len(missing) + len(bad)
    return ValidationReport(
        passed=failures <= max_bad_samples,
        samples_expected=len(checked),
        samples_valid=valid,
        missing=missing,
        bad=bad,
        tokens=tokens,
        bytes=size,
        layer_count=files.layer_count,
        hidden_size=files.hidden_size,
        files_dir=[str(files.folder)],
    )


def failure_message(report: ValidationReport, max_bad_samples: int) -> str:
    rows = [(row, "missing") for row in report.missing[:MAX_LISTED]]
    rows += [(row, reason) for row, reason in list(report.bad.items())[:MAX_LISTED]]
    table = render_table(["row", "problem"], rows)
    return (
        f"{len(report.missing)} missing and {len(report.bad)} bad hidden-state files of {report.samples_expected} "
        f"(allowed: {max_bad_samples}):\n{table}\n"
        "Rerun extraction for the affected replica (it redoes invalid files and keeps valid ones), e.g. "
        "`snakemake --forcerun extract_hidden_states ...`; raise validation.max_bad_samples only if you accept "
        "training without those samples."
    )
