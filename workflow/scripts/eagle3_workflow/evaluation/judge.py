"""Judging evaluate_draft's measurements: the lossless verdict (every run's emitted tokens against its own argmax,
the trained draft's greedy output against the reference's), each draft's results (acceptance, speed-up, verdict),
the train/serve consistency, draft parity (parity.draft_parity) and the report with the notes a reader needs.
The judgement keeps nothing across attempts: a resumed attempt judges again (resume).

Lossless reference (plan.lossless_reference): the untrained draft's run (CPU), exactly; the run without
speculation (CUDA, batch-invariant kernels), with ``evaluate.lossless_tie_steps``; or none (the argmax check alone),
each comparison recorded either way (docs/faults.md, 'The lossless verdict').
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle3_workflow.evaluation.baseline import UntrainedDraft
from eagle3_workflow.evaluation.consistency import consistency_table, judge_consistency
from eagle3_workflow.evaluation.lossless import compare_greedy, non_argmax_gaps, non_argmax_steps
from eagle3_workflow.evaluation.measurements import UNTRAINED_DIVERGENT, Evaluation, Measured, prompt_outputs
from eagle3_workflow.evaluation.metrics import acceptance_result, summary_table, throughput
from eagle3_workflow.evaluation.parity import draft_parity
from eagle3_workflow.evaluation.prompts import PromptSet
from eagle3_workflow.evaluation.protocol import NO_SPECULATION, RunResult
from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.draft_artefacts import (
    AcceptanceReport,
    AcceptanceResult,
    DraftParity,
    LosslessMismatch,
    Throughput,
    TrainingSummary,
    TrainServeConsistency,
)
from eagle3_workflow.reference.target_config import read_target_config
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import EvaluationSettings

log = logging.getLogger("eagle3.evaluation")

DRAFTS = ("trained", "untrained")

Outputs = dict[int, tuple[list[int], list[dict[int, float]]]]  # a lossless pass's output and top-k logits by prompt


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The report (eval/acceptance.json) and the three checks it records that can fail the stage."""

    report: AcceptanceReport
    lossless: LosslessVerdict
    parity: DraftParity
    consistency: TrainServeConsistency


def judge_measurements(
    measured: Measured,
    evaluation: Evaluation,
    *,
    draft: Path,
    untrained: UntrainedDraft,
    target: Path,
    logit_dtype: str,
    numerics: str,
    reference: str,
    trust_remote_code: bool,
    decode: Callable[[Sequence[int]], str],
    reference_device: str,
) -> Judgement:
    """The measurements judged: the lossless verdict, each draft's results and the report's notes, the train/serve
    consistency and the draft parity check, logged with the summary table."""
    settings, prompt_set = evaluation.settings, evaluation.prompt_set
    verdict = lossless_verdict(measured.lossless, prompt_set, logit_dtype=logit_dtype, numerics=numerics,
                               tie_steps=settings.lossless_tie_steps, decode=decode, reference=reference)  # fmt: skip
    results = draft_results(measured, verdict, {"trained": draft, "untrained": untrained.path},
                            settings.num_speculative_tokens)  # fmt: skip
    notes = prompt_set.notes + report_notes(results, verdict, measured, evaluation)
    report = build_report(results, verdict, measured, evaluation, untrained_baseline=untrained.description, notes=notes)
    consistency = train_serve_consistency(draft, results["trained"], settings)
    parity = draft_parity(measured.lossless["trained"], prompt_set, draft=draft, target=target,
                          k=settings.num_speculative_tokens, dtype=logit_dtype, trust_remote_code=trust_remote_code,
                          decode=decode, reference_device=reference_device)  # fmt: skip
    report = report.model_copy(update={"consistency": consistency, "parity": parity})
    log.info("\n%s", summary_table(report))
    log.info(
        "train/serve consistency %s: %s\n%s", consistency.verdict, consistency.reason, consistency_table(consistency)
    )
    return Judgement(report=report, lossless=verdict, parity=parity, consistency=consistency)


def resolved_dtype(dtype: str, target: Path) -> str:
    """The dtype the target's logits come in: the config's, or the checkpoint's own for 'auto'."""
    if dtype != "auto":
        return dtype
    return read_target_config(target).dtype or "bfloat16"


def train_serve_consistency(
    draft: Path, trained: AcceptanceResult, settings: EvaluationSettings
) -> TrainServeConsistency:
    """The trained draft's served acceptance against its own validation accuracy (draft/training.json, which
    train_draft writes beside the weights; a draft without one is recorded as not judged)."""
    summary_path = draft / "training.json"
    predicted = load(TrainingSummary, summary_path).final_val_full_acc if summary_path.is_file() else None
    return judge_consistency(predicted, trained.per_position_acceptance, num_drafts=trained.num_drafts,
                             min_ratio=settings.consistency_min_ratio,
                             min_predicted=settings.consistency_min_predicted)  # fmt: skip


# ---------------------------------------------------------------------------------------------- the lossless verdict


@dataclasses.dataclass
class LosslessVerdict:
    """Each draft's first divergences from the reference, and every token a run emitted that is not its own
    argmax (the reference's own such tokens under the label no_speculation)."""

    mismatches: dict[str, list[LosslessMismatch]]
    non_argmax: dict[str, list[str]]
    criterion: str
    numerics: str  # the kernels of the lossless pass: batch_invariant | production
    logit_dtype: str  # the dtype whose steps measure a tie
    reference: str = NO_SPECULATION  # the run each judged draft is compared with: untrained | no_speculation
    # each label's smallest gap (dtype steps) of an emitted token below its step's argmax: the argmax check's margin
    non_argmax_min_gap: dict[str, float | None] = dataclasses.field(default_factory=dict)
    # with the untrained reference: each draft's first divergences from the run without speculation (not judged)
    against_no_speculation: dict[str, list[LosslessMismatch]] = dataclasses.field(default_factory=dict)
    # with no reference (none): the trained draft's first divergences from the untrained draft's run (not judged)
    against_untrained: list[LosslessMismatch] = dataclasses.field(default_factory=list)

    def judged(self) -> dict[str, list[LosslessMismatch]]:
        """The drafts compared with the reference (not the reference itself)."""
        return {label: ms for label, ms in self.mismatches.items() if label != self.reference}


@dataclasses.dataclass(frozen=True)
class LosslessOutputs:
    """Every lossless pass's outputs by prompt (the untrained draft's two passes as one), the prompts' origins, and
    what a comparison of two runs needs: the logits' dtype and the tokenizer's decode."""

    by_prompt: dict[str, Outputs]
    origins: list[str]
    logit_dtype: str
    decode: Callable[[Sequence[int]], str]

    def against(self, base: str, label: str, ties: int, prompts: Sequence[int] | None = None) -> list[LosslessMismatch]:
        """`label`'s first divergences from `base` on `prompts` (None: every prompt both runs generated)."""
        by_prompt, origins = self.by_prompt, self.origins
        shared = sorted(by_prompt[base].keys() & by_prompt[label].keys()) if prompts is None else list(prompts)
        found = compare_greedy(([by_prompt[base][i][0] for i in shared], [by_prompt[base][i][1] for i in shared]),
                               ([by_prompt[label][i][0] for i in shared], [by_prompt[label][i][1] for i in shared]),
                               origins=[origins[i] for i in shared], dtype=self.logit_dtype, tie_steps=ties,
                               decode=self.decode)  # fmt: skip
        return [m.model_copy(update={"prompt_index": shared[m.prompt_index]}) for m in found]

    def full(self) -> dict[str, tuple[list[list[int]], list[list[dict[int, float]]]]]:
        """Each run's prompts in full (a prompt it did not generate: no tokens), so that the messages name the
        prompt."""
        n = len(self.origins)
        return {label: ([runs.get(i, ([], []))[0] for i in range(n)], [runs.get(i, ([], []))[1] for i in range(n)])
                for label, runs in self.by_prompt.items()}  # fmt: skip


def lossless_outputs(
    lossless: dict[str, RunResult], prompt_set: PromptSet, *, logit_dtype: str, decode: Callable[[Sequence[int]], str]
) -> LosslessOutputs:
    by_prompt = {label: prompt_outputs(run) for label, run in lossless.items() if label != UNTRAINED_DIVERGENT}
    if "untrained" in lossless:
        by_prompt["untrained"] = untrained_outputs(lossless)
    origins = [p.origin for p in prompt_set.prompts]
    return LosslessOutputs(by_prompt=by_prompt, origins=origins, logit_dtype=logit_dtype, decode=decode)


def untrained_outputs(lossless: dict[str, RunResult]) -> Outputs:
    """The untrained draft's outputs by prompt: its first prompts' pass and, if one ran, the pass on the prompts
    where the trained draft's output differs from the run without speculation."""
    merged = prompt_outputs(lossless["untrained"])
    if UNTRAINED_DIVERGENT in lossless:
        merged |= prompt_outputs(lossless[UNTRAINED_DIVERGENT])
    return merged


@dataclasses.dataclass(frozen=True)
class Judged:
    """What one reference judges: each draft's mismatches, the criterion in words, and the comparisons recorded but
    not judged (LosslessVerdict's fields of the same names)."""

    mismatches: dict[str, list[LosslessMismatch]]
    criterion: str
    against_no_speculation: dict[str, list[LosslessMismatch]] = dataclasses.field(default_factory=dict)
    against_untrained: list[LosslessMismatch] = dataclasses.field(default_factory=list)


def lossless_verdict(
    lossless: dict[str, RunResult],
    prompt_set: PromptSet,
    *,
    logit_dtype: str,
    tie_steps: int,
    numerics: str,
    decode: Callable[[Sequence[int]], str],
    reference: str = NO_SPECULATION,
) -> LosslessVerdict:
    """The lossless pass judged: every run's emitted tokens against its own argmax, and the trained draft's greedy
    output against the reference's (`reference`: untrained, exactly; no_speculation, with `tie_steps`; with the
    run without speculation as the reference the untrained draft is judged against it too).

    With the untrained reference, a prompt passes when the trained draft's output equals the one without
    speculation token for token (lossless by definition: nothing to excuse), or else equals the untrained draft's
    run on that prompt (the same verifier numerics: measure_untrained_reference generated it); each draft's
    divergences from the run without speculation are recorded. The untrained draft's pass covers only its first
    evaluate.untrained_prompts and those prompts, so its own comparisons cover those."""
    outputs = lossless_outputs(lossless, prompt_set, logit_dtype=logit_dtype, decode=decode)
    if reference == "none":
        judged = judged_without_reference(outputs)
    elif reference == "untrained":
        judged = judged_against_untrained(outputs)
    else:
        judged = judged_against_no_speculation(outputs, tie_steps)
    full = outputs.full()
    non_argmax = {label: non_argmax_steps(*run, logit_dtype) for label, run in full.items()}
    min_gap = {
        label: min((gap[-1] for gap in non_argmax_gaps(*run, logit_dtype)), default=None) for label, run in full.items()
    }
    return LosslessVerdict(mismatches=judged.mismatches, non_argmax=non_argmax, criterion=judged.criterion,
                           numerics=numerics, logit_dtype=logit_dtype, reference=reference, non_argmax_min_gap=min_gap,
                           against_no_speculation=judged.against_no_speculation,
                           against_untrained=judged.against_untrained)  # fmt: skip


def judged_without_reference(outputs: LosslessOutputs) -> Judged:
    """evaluate.lossless_reference none: the argmax check alone; both comparisons recorded."""
    return Judged(
        mismatches={"trained": [], "untrained": []},
        criterion=(
            "every emitted token of every run is its own argmax; the trained draft's divergences from the untrained "
            "draft's run (both one prompt at a time) and from the run without speculation are recorded, not judged "
            "(evaluate.lossless_reference: none)"
        ),
        against_no_speculation={label: outputs.against(NO_SPECULATION, label, 0) for label in DRAFTS},
        against_untrained=outputs.against("untrained", "trained", 0),
    )


def judged_against_untrained(outputs: LosslessOutputs) -> Judged:
    """The untrained reference: where the trained draft's output differs from the run without speculation, it must
    equal the untrained draft's run on that prompt exactly."""
    report_only = {label: outputs.against(NO_SPECULATION, label, 0) for label in DRAFTS}
    differing = [m.prompt_index for m in report_only["trained"]]
    unreferenced = [i for i in differing if i not in outputs.by_prompt["untrained"]]
    if unreferenced:
        raise StageError(f"the untrained draft's run lacks prompt(s) {unreferenced}, where the trained draft's "
                         "output differs from the run without speculation (a bug: measure_untrained_reference "
                         "generates them)")  # fmt: skip
    return Judged(
        mismatches={"trained": outputs.against("untrained", "trained", 0, differing), "untrained": []},
        criterion=(
            "exact: every prompt's greedy output with the trained draft equals the output without speculation, or "
            "where it does not, the untrained draft's on that prompt, both speculative runs generated one prompt at a "
            "time (the same 1 + k verified rows at every step); every emitted token of every run is its own argmax"
        ),
        against_no_speculation=report_only,
    )


def judged_against_no_speculation(outputs: LosslessOutputs, tie_steps: int) -> Judged:
    """The run without speculation as the reference: both drafts judged against it, a first divergence passing
    only as a tie within `tie_steps` (0: exact)."""
    mismatches = {label: outputs.against(NO_SPECULATION, label, tie_steps) for label in DRAFTS}
    if tie_steps == 0:
        criterion = "exact: every prompt's speculative greedy output equals the output without speculation"
    else:
        criterion = (
            f"every emitted token is its run's own argmax, and a first divergence passes only as a tie within "
            f"{tie_steps} {outputs.logit_dtype} step(s) at the logits' magnitude in both runs"
        )
    return Judged(mismatches=mismatches, criterion=criterion)


# ---------------------------------------------------------------------------------------------- results and report


def draft_results(
    measured: Measured,
    verdict: LosslessVerdict,
    draft_paths: dict[str, Path],
    num_speculative_tokens: int,
) -> dict[str, AcceptanceResult]:
    """Each draft's acceptance, speed-up over the reference and lossless verdict (with the argmax check's margin
    and, under the untrained reference, its divergences from the run without speculation)."""
    results = {
        label: acceptance_result(
            measured.lossless[label],
            measured.timing.get(label),  # None: not timed (evaluate.time_untrained false)
            draft_path=Path(path),
            num_speculative_tokens=num_speculative_tokens,
            reference_timing=measured.timing[NO_SPECULATION],
            mismatches=verdict.mismatches[label],
            non_argmax=verdict.non_argmax[label] + verdict.non_argmax[NO_SPECULATION],
        )
        for label, path in draft_paths.items()
    }
    for label, result in results.items():
        gaps = [g for g in (verdict.non_argmax_min_gap.get(label), verdict.non_argmax_min_gap.get(NO_SPECULATION))
                if g is not None]  # fmt: skip
        results[label] = result.model_copy(update={
            "non_argmax_min_gap_steps": round(min(gaps), 3) if gaps else None,
            "no_speculation_divergences": verdict.against_no_speculation.get(label, []),
            "untrained_divergences": verdict.against_untrained if label == "trained" else [],
            "acceptance_prompts": measured.lossless[label].prompt_indices,
            "reference_prompts": (measured.lossless[UNTRAINED_DIVERGENT].prompt_indices or []
                                  if label == "untrained" and UNTRAINED_DIVERGENT in measured.lossless else []),
        })  # fmt: skip
    return results


def build_report(
    results: dict[str, AcceptanceResult],
    verdict: LosslessVerdict,
    measured: Measured,
    evaluation: Evaluation,
    *,
    untrained_baseline: str,
    notes: list[str],
) -> AcceptanceReport:
    """eval/acceptance.json from the measured runs."""
    settings, prompt_set, stop = evaluation.settings, evaluation.prompt_set, evaluation.stop
    reference = measured.lossless[NO_SPECULATION]
    reference_throughput = throughput(measured.timing[NO_SPECULATION], None)
    return AcceptanceReport(
        num_prompts=len(prompt_set.prompts),
        prompt_source=prompt_set.source,
        num_speculative_tokens=settings.num_speculative_tokens,
        max_tokens=settings.max_tokens,
        trained=results["trained"],
        untrained=results["untrained"],
        no_speculation_tokens_per_s=reference_throughput[0].tokens_per_s if reference_throughput else 0.0,
        no_speculation_throughput=reference_throughput,
        lossless=all(r.lossless for r in results.values()),
        lossless_mismatches=sum(len(ms) for ms in verdict.judged().values()),
        lossless_reference=verdict.reference,
        num_prompts_requested=prompt_set.requested,
        prompt_detail=prompt_set.detail,
        device=evaluation.device,
        vllm_version=measured.vllm_version,
        no_speculation_generated_tokens=reference.generated_tokens,
        no_speculation_generate_s=reference.generate_s,
        no_speculation_engine_start_s=measured.timing[NO_SPECULATION].engine_start_s,
        lossless_numerics=verdict.numerics,
        logit_dtype=verdict.logit_dtype,
        lossless_tie_steps=settings.lossless_tie_steps,
        lossless_criterion=verdict.criterion,
        untrained_baseline=untrained_baseline,
        processes=measured.processes,
        notes=notes,
        stop_token_ids=stop.token_ids,
        stop_strings=stop.strings,
    )


def report_notes(
    results: dict[str, AcceptanceResult], verdict: LosslessVerdict, measured: Measured, evaluation: Evaluation
) -> list[str]:
    """What a reader of the numbers must know: ties, a draft that does not beat its baseline, why speculation
    does not pay at batch 1, CPU timing, server flags that an offline engine does not take."""
    settings, device, vllm_settings = evaluation.settings, evaluation.device, evaluation.vllm_settings
    notes = []
    ties = sum(m.tie for ms in verdict.mismatches.values() for m in ms)
    if ties:
        notes.append(f"{ties} first divergence(s) passed as ties within {settings.lossless_tie_steps} dtype step(s)")
    notes += reference_notes(results, verdict, total=len(evaluation.prompt_set.prompts))
    if results["trained"].mean_acceptance_length <= results["untrained"].mean_acceptance_length:
        notes.append(
            f"the trained draft does not beat the untrained baseline (mean acceptance length "
            f"{results['trained'].mean_acceptance_length:.3f} vs {results['untrained'].mean_acceptance_length:.3f})"
        )
    notes += step_time_notes(results["trained"], throughput(measured.timing[NO_SPECULATION], None))
    untimed = [label for label, result in results.items() if not result.throughput]
    if untimed:
        notes.append(
            f"not timed (evaluate.time_untrained false): {', '.join(untimed)}; acceptance and the lossless verdict "
            "are measured all the same, tokens/s and speedup are not (0 in this file)"
        )
    if measured.reused:
        notes.append(
            f"measured by an earlier attempt of this stage and reused (same key: the draft, target, prompts, kernels "
            f"and versions unchanged): {', '.join(measured.reused)}; `processes` lists only this attempt's"
        )
    if measured.concurrent:
        notes.append(
            "the measurement processes ran at once; each timing pass (its warm-up and measured passes) held the "
            "evaluation's lock alone, so no other process imported vLLM, started an engine or generated meanwhile "
            "(each process's waits for the lock: processes[].lock_wait_s)"
        )
    if device == "cpu":
        notes.append(
            "tokens/s measured on CPU (host load average "
            + ", ".join(str(p.load_1m) for p in measured.processes)
            + "): indicative only; acceptance does not depend on timing"
        )
    if vllm_settings.extra_args:
        notes.append(f"vllm.extra_args {list(vllm_settings.extra_args)} are server flags and were not applied here")
    return notes


def reference_notes(results: dict[str, AcceptanceResult], verdict: LosslessVerdict, *, total: int) -> list[str]:
    """What the lossless reference was and what it judged, where it is a speculative run (untrained or none): the
    prompts where the drafts' outputs differ from the run without speculation, the untrained draft's prompts."""
    if verdict.reference == "untrained":
        differing = [m.prompt_index for m in verdict.against_no_speculation["trained"]]
        untrained = results["untrained"]
        counted = untrained.acceptance_prompts or []
        return [
            f"lossless reference: the run without speculation, token for token; where the trained draft's output "
            f"differs from it ({len(differing)}/{total} prompts{f': {differing}' if differing else ''}), the "
            "untrained draft's run on that prompt, token for token, both speculative lossless passes one prompt at a "
            "time (the same 1 + k verified rows at every step: docs/faults.md, 'The lossless verdict'). The untrained "
            f"draft generated its first {len(counted)} prompt(s) (its acceptance counts these; "
            f"{len(verdict.against_no_speculation['untrained'])} of them differ from the run without speculation) "
            + (
                f"and prompts {untrained.reference_prompts} as the reference"
                if untrained.reference_prompts
                else "and no other: none needed it as the reference"
            )  # fmt: skip
        ]
    if verdict.reference != NO_SPECULATION:
        recorded = {label: len(ms) for label, ms in verdict.against_no_speculation.items()}
        what = (f"none: the argmax check alone ({len(verdict.against_untrained)}/{total} prompts differ from the "
                "untrained draft's run, in trained.untrained_divergences)")  # fmt: skip
        return [
            f"lossless reference: {what}; both speculative lossless passes ran one prompt at a time (the same 1 + k "
            "verified rows at every step); against the run without speculation (one row a step) "
            + ", ".join(f"{n}/{total} prompts differ with the {label} draft" for label, n in recorded.items())
            + " (<draft>.no_speculation_divergences, recorded, not judged: docs/faults.md, 'The lossless verdict')"
        ]
    return []


def step_time_notes(trained: AcceptanceResult, reference: list[Throughput]) -> list[str]:
    """At concurrency 1: speculation pays when acceptance length x target step time > verification step time."""
    spec = next((t for t in trained.throughput if t.concurrency == 1), None)
    plain = next((t for t in reference if t.concurrency == 1), None)
    if spec is None or plain is None or not spec.ms_per_step or not plain.ms_per_step:
        return []
    tokens_per_step = spec.generated_tokens / (spec.seconds * 1000 / spec.ms_per_step)
    return [
        f"at concurrency 1: a target step takes {plain.ms_per_step:.2f} ms without speculation; a speculative step "
        f"(the draft proposes {len(trained.per_position_acceptance)} tokens, then one verification) "
        f"takes {spec.ms_per_step:.2f} ms ({spec.ms_per_step / plain.ms_per_step:.2f}x) and yields "
        f"{tokens_per_step:.2f} tokens, so speculation pays when that ratio is below the tokens per step"
    ]
