"""Train/serve consistency (pure): does the served draft accept what its own validation accuracy predicts?

What the validation accuracy predicts. speculators logs, per TTT step k, ``full_acc_k`` and ``cond_acc_k``
(speculators.models.metrics.compute_accuracy_single_step, eagle3/metrics.py): at every loss-masked position the
draft's argmax at step k is compared with the verifier's argmax there, and ``prev_correct`` is AND-ed in place, so
``full_acc_k`` = the fraction of positions where steps 0..k were *all* right (cumulative, over every masked
position), and ``cond_acc_k`` = the same count over the positions whose steps 0..k-1 were right (conditional).
vLLM's greedy verification accepts draft position k exactly when positions 0..k all equal the target's argmax, and
evaluate_draft's ``per_position_acceptance[k]`` is (accepted at position k) / (drafts): the served counterpart of
``full_acc_k``, not of ``cond_acc_k``. So draft/training.json's ``final_val_full_acc`` (the last validation pass)
predicts ``per_position_acceptance`` position by position, and ``1 + sum(final_val_full_acc)`` predicts the mean
acceptance length.

They are not equal on a healthy draft: validation runs on held-out rows of the training distribution and the
evaluation prompts may be another (HumanEval), and a short evaluation has few drafts. Measured on healthy runs,
served / predicted at position 0 was 0.70 (SmolLM2-135M on the H200, 164 HumanEval prompts, a weak draft: 0.158
predicted, 0.111 served), 0.88 (SmolLM2-135M on the H200, 2026-12-01: 0.785 predicted, 0.69 served) and 0.48 (the
Kimi stand-in on CPU, 7 held-out prompts, 117 drafts: 0.672 predicted, 0.325 served). A draft that validates well
and serves badly collapses instead: a d2t shifted by one id serves ~0 at every position (tests: a scratch-built
draft serves 0.000, the tiny run's shifted d2t served 1.000 mean acceptance length against 1.306 healthy).

The rule. At position 0 (every draft has one; it has the most samples and no TTT-step effects):
fail when ``served[0] < evaluate.consistency_min_ratio x predicted[0]`` (default 0.25: the worst healthy run
above sits ~2x over that bar, a collapse well under it). It compares served with predicted, never with an
absolute bar, so a weak draft that validated equally weak passes. Not judged (recorded, no failure) when
training.json is absent or has no validation accuracy, when ``predicted[0] < evaluate.consistency_min_predicted``
(default 0.05: too weak a prediction for a ratio to mean anything), when the pass proposed fewer than
MIN_DRAFTS drafts, or when ``consistency_min_ratio`` is 0 (off). Later positions are shown, not judged.
"""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_workflow.files.draft_artefacts import TrainServeConsistency
from eagle3_workflow.settings.errors import render_table

# fewer drafts than this and a served rate is mostly noise (a binomial 0.3 from 20 drafts: +-0.1)
MIN_DRAFTS = 20

LIKELY_CAUSES = (
    "a regenerated or misaligned d2t/t2d vocabulary mapping (the draft's d2t/t2d tensors are not the ones it was "
    "trained with: compare draft/training.json's vocab_mapping_sha256 with train_work/data/d2t-*.npy, t2d-*.npy)",
    "a draft config whose max_position_embeddings is cut below the served context (draft/config.json's "
    "transformer_layer_config.max_position_embeddings vs vllm.max_model_len and the prompts' lengths)",
    "a layer-id offset between trainer and server (draft/config.json's eagle_aux_hidden_state_layer_ids vs "
    "training.json's target_layer_ids and the layers the server captures)",
    "a chat template that differs between data prep and serving (the prompts are rendered with the target's "
    "template now: was the target or its tokenizer_config.json replaced after prepare_data?)",
)


def judge_consistency(
    predicted: Sequence[float] | None,
    served: Sequence[float],
    *,
    num_drafts: int,
    min_ratio: float,
    min_predicted: float,
) -> TrainServeConsistency:
    """The verdict of the rule in the module docstring: `predicted` = the draft's final validation full_acc_k
    (None: no training.json), `served` = the trained draft's per-position acceptance."""
    predicted_list = [float(p) for p in predicted or []]
    served_list = [float(s) for s in served]
    n = min(len(predicted_list), len(served_list))
    ratios = [served_list[i] / predicted_list[i] if predicted_list[i] > 0 else None for i in range(n)]
    base = dict(predicted=predicted_list, served=served_list, ratio=ratios, min_ratio=min_ratio,
                min_predicted=min_predicted, num_drafts=num_drafts)  # fmt: skip
    if min_ratio <= 0:
        return TrainServeConsistency(**base, verdict="not judged", reason="evaluate.consistency_min_ratio is 0 (off)")
    if n == 0:
        return TrainServeConsistency(
            **base, verdict="not judged", reason="no validation accuracy (draft/training.json absent or empty)"
        )
    if predicted_list[0] < min_predicted:
        return TrainServeConsistency(**base, verdict="not judged", reason=(
            f"predicted position-0 acceptance {predicted_list[0]:.3f} < evaluate.consistency_min_predicted "
            f"{min_predicted}: too weak a draft for the ratio to mean anything"))  # fmt: skip
    if num_drafts < MIN_DRAFTS:
        return TrainServeConsistency(**base, verdict="not judged", reason=(
            f"only {num_drafts} drafts proposed (< {MIN_DRAFTS}): the served rate is noise"))  # fmt: skip
    bar = min_ratio * predicted_list[0]
    if served_list[0] < bar:
        return TrainServeConsistency(**base, verdict="failed", reason=(
            f"served position-0 acceptance {served_list[0]:.3f} < {min_ratio} x predicted {predicted_list[0]:.3f} "
            f"= {bar:.3f}"))  # fmt: skip
    return TrainServeConsistency(**base, verdict="passed", reason=(
        f"served position-0 acceptance {served_list[0]:.3f} >= {min_ratio} x predicted {predicted_list[0]:.3f} "
        f"= {bar:.3f}"))  # fmt: skip


def consistency_table(result: TrainServeConsistency) -> str:
    """Position by position: predicted (validation full_acc_k), served, their ratio; the bar at position 0."""
    rows = []
    for i, served in enumerate(result.served):
        predicted = result.predicted[i] if i < len(result.predicted) else None
        ratio = result.ratio[i] if i < len(result.ratio) else None
        bar = f">= {result.min_ratio * predicted:.3f}" if i == 0 and predicted is not None else "(shown, not judged)"
        rows.append((i, "-" if predicted is None else f"{predicted:.3f}", f"{served:.3f}",
                     "-" if ratio is None else f"{ratio:.2f}", bar))  # fmt: skip
    return render_table(["position", "predicted (val full_acc)", "served", "served/predicted", "bar"], rows)


def consistency_failure(result: TrainServeConsistency, *, draft: str) -> str:
    """The StageError message: the verdict, the table, the likely causes and how to tell them apart."""
    causes = "\n".join(f"  - {cause}" for cause in LIKELY_CAUSES)
    return (
        f"train/serve consistency FAILED for {draft}: the draft validated well and serves badly ({result.reason}; "
        f"{result.num_drafts} drafts).\n{consistency_table(result)}\n"
        f"Validation accuracy (speculators' full_acc_k) predicts the served per-position acceptance; a collapse "
        f"means the served draft is not the model that was validated, or is fed other inputs. Likely causes:\n"
        f"{causes}\n"
        "Fix the cause and rerun evaluate_draft. If the evaluation prompts are far from the training data and the "
        "gap is real, lower evaluate.consistency_min_ratio (0 turns the check off)."
    )
