"""Stage `canary`: the production extraction path on a few-layer slice of the real checkpoint.

1. Truncate (slice.py): same config with K layers (every distinct layer type covered, e.g. DeepSeek-V3/Kimi's dense
   layers plus the first MoE layer, and at least 8 so the id set can have production's shape), reading only
   the needed tensors lazily from the safetensors shards.
2. Serve it exactly as extraction does (same spec builder, connector, tensor-parallel size, client code) and
   extract a handful of prepared samples, capturing ids shaped like production's [2, N//2, N-3, N]:
   [2, K//2, K-2, K] (gaps between all ids, last = K). A contiguous 1..K set would hide any remap that keeps
   the number of ids (issue 13: id k taken from layer k+1 whenever k+1 < N).
3. Compare with an independent fp32 reference (canary.reference: hf_fp32, the default): transformers' own forward
   of the slice, streamed one decoder layer at a time (reference.full_depth.stream_reference, the full-depth
   check's reference: one reference for both gates, quantized checkpoints included where it reads them), in the
   documented convention (id k < K = the input of layer k, id K = pre-norm output of the last layer), for EVERY
   layer 0..K plus the post-norm output. Each captured slot is matched to the reference it is nearest to (distance
   summed over all tokens of all samples); the `layer-id convention` row fails, naming the layer, when that is not
   the id the slot claims. Shift, swap, one layer for all ids, post-norm for K: all are a wrong nearest layer.
   The margin to the runner-up is recorded (adjacent layers of a tiny random model can be close). The error row
   (max rel error within tolerance) follows layer_match's rule: on an MoE target, a token above the tolerance is
   excused only where the reference's router margins show a near-tie bf16 serving may have routed the other way.
4. Also: shapes [T, L, H], dtype, finite, non-degenerate, token ids round-trip, and the server's chat rendering
   (render endpoint) equals prepare_data's ids.
No silent weaker proof: a target the reference cannot run fails (check_api's `canary reference` row says so before
any server starts). Only `canary.reference: self_consistency` replaces the reference with two extractions that must
be bit-identical, which a capture wrong the same way twice passes; the artefact's `proof` says which ran.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from eagle3_workflow.canary.slice import CanarySlice, build_truncated_target, canary_layer_count, canary_layer_ids
from eagle3_workflow.files.artefacts import CheckRow, check_table
from eagle3_workflow.files.data_artefacts import CanaryReport, LayerMatch
from eagle3_workflow.files.hidden_states import read_hidden_states, read_sample
from eagle3_workflow.files.prepared import open_prepared
from eagle3_workflow.reference.full_depth import REFERENCE, Target, UnsupportedTarget, open_target, stream_reference
from eagle3_workflow.reference.layer_match import MAX_EXCUSED_FRACTION, SlotComparison, SlotError, SlotMatch
from eagle3_workflow.reference.target_config import read_target_config
from eagle3_workflow.serving.extraction_client import ClientSettings, ProgressTracker, Sample, extract_samples
from eagle3_workflow.serving.server import VLLMServer
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.sections import ExtractionStall
from eagle3_workflow.settings.stages import CanaryStage

log = logging.getLogger("eagle3.canary")


def convention_row(matches: list[SlotMatch], layers: int) -> CheckRow:
    expected = f"each id nearest to its own layer of all 0..{layers} (+ post-norm)"
    wrong = [m for m in matches if not m.ok]
    if wrong:
        found = "; ".join(
            f"id {m.claimed} is layer {m.best} (rel {m.best_rel:.3g}; vs its own layer {m.own_rel:.3g})" for m in wrong
        )
        return CheckRow(name="layer-id convention", expected=expected, found=f"WRONG LAYER: {found}", passed=False)
    weakest = min(matches, key=lambda m: m.margin)
    found = (
        f"ok; weakest margin {weakest.margin:.1f}x (id {weakest.claimed}: rel {weakest.best_rel:.3g}, "
        f"next nearest layer {weakest.runner_up} at {weakest.runner_up_rel:.3g})"
    )
    return CheckRow(name="layer-id convention", expected=expected, found=found, passed=True)


def render_check(server: VLLMServer, messages: list[dict[str, str]], expected_ids: list[int]) -> str | None:
    """None if the server renders the conversation to the ids prepare_data stored (prefix when truncated)."""
    import httpx

    response = httpx.post(
        f"{server.base_url}/v1/chat/completions/render",
        headers=server.headers(),
        timeout=60,
        json={"model": server.spec.served_model_name, "messages": messages, "add_generation_prompt": False},
    )
    if response.status_code != 200:
        return f"render endpoint HTTP {response.status_code}: {response.text[:300]}"
    payload = response.json()
    ids = payload.get("token_ids")
    if ids is None and isinstance(payload, list) and payload:
        ids = payload[0].get("token_ids")
    if ids is None:
        return f"render response has no token_ids: {json.dumps(payload)[:300]}"
    if list(ids[: len(expected_ids)]) != list(expected_ids):
        first = next(
            (i for i, (a, b) in enumerate(zip(ids, expected_ids, strict=False)) if a != b),
            min(len(ids), len(expected_ids)),
        )
        return (
            f"server renders {len(ids)} ids, prepare_data stored {len(expected_ids)}; first difference at "
            f"position {first}: server {ids[first : first + 5]} vs prep {expected_ids[first : first + 5]}"
        )
    return None


HF_FP32 = "hf_fp32"
SELF_CONSISTENCY = "self_consistency"
REFERENCE_NOTES = {
    HF_FP32: f"{REFERENCE} (the canary's slice)",
    SELF_CONSISTENCY: (
        "none: canary.reference is self_consistency, so two extractions must be bit-identical (weaker: a capture "
        "wrong the same way twice passes)"
    ),
}
NO_REFERENCE_FIX = (
    "Fix: a transformers that runs this checkpoint (check_api's `canary reference` row checks it before any server "
    "starts), or set canary.reference: self_consistency to accept the weaker proof (recorded in canary.json)"
)


@dataclasses.dataclass
class FileFindings:
    shape_ok: bool = True
    dtype_ok: bool = True
    finite_ok: bool = True
    varied_ok: bool = True
    ids_ok: bool = True
    repeat_ok: bool = True
    errors: dict[str, SlotError] = dataclasses.field(default_factory=dict)
    matches: list[SlotMatch] = dataclasses.field(default_factory=list)

    @property
    def max_rel(self) -> dict[str, float]:
        return {k: e.max_rel for k, e in self.errors.items()}

    @property
    def mean_rel(self) -> dict[str, float]:
        return {k: e.mean_rel for k, e in self.errors.items()}


def inspect_files(
    samples: list[Sample],
    piece: CanarySlice,
    proof: str,
    *,
    files_dir: Path,
    repeat_dir: Path,
    tolerance: float,
    trust_remote_code: bool,
    reference_device: str,
    opened: Callable[[], Target] | None = None,
) -> FileFindings:
    """Read every extracted file once: format checks, and (hf_fp32) against the streamed fp32 reference of every
    layer of the slice, all samples in one batch. `opened` gives the slice's reference skeleton when it was built
    beforehand (opening_reference; what open_target raised is raised here)."""
    layer_ids = piece.layer_ids
    found = FileFindings()
    slots: list[torch.Tensor] = []
    for sample in samples:
        hidden, token_ids = read_sample(files_dir, sample.row)
        found.shape_ok &= list(hidden.shape) == [len(sample.input_ids), len(layer_ids), piece.hidden_size]
        found.dtype_ok &= hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
        found.finite_ok &= bool(torch.isfinite(hidden).all())
        found.varied_ok &= all(float(hidden[:, j].float().std()) > 0 for j in range(hidden.shape[1]))
        found.ids_ok &= token_ids.tolist() == sample.input_ids
        if proof == SELF_CONSISTENCY:
            found.repeat_ok &= torch.equal(read_hidden_states(repeat_dir, sample.row), hidden)
        slots.append(hidden)
    if proof == SELF_CONSISTENCY or not (found.finite_ok and found.shape_ok) or not slots:
        return found  # a bad shape or NaN fails its own row; the reference rows then fail as "not compared"
    comparison = SlotComparison(slots, layer_ids)
    batch = [sample.input_ids for sample in samples]
    try:
        target = opened() if opened is not None else None
        with comparison.routing:
            num_layers, _ = stream_reference(piece.model_dir, batch, comparison, trust_remote_code=trust_remote_code,
                                             opened=target, device=reference_device)  # fmt: skip
    except UnsupportedTarget as exc:
        raise StageError(
            f"the canary's fp32 reference cannot run the slice of this target: {exc.reason}. {NO_REFERENCE_FIX}"
        ) from exc
    found.matches = comparison.matches(num_layers)
    found.errors = comparison.errors(tolerance)
    return found


def build_checks(
    found: FileFindings,
    piece: CanarySlice,
    render_problems: list[tuple[int, str | None]],
    *,
    tolerance: float,
    proof: str,
) -> list[CheckRow]:
    layer_ids, hidden_size = piece.layer_ids, piece.hidden_size
    bad_render = [f"sample {i}: {p}" for i, p in render_problems if p]
    checks = [
        _check("shape [T, L, H]", f"[T, {len(layer_ids)}, {hidden_size}]", found.shape_ok, "mismatch"),
        _check("dtype", "bf16/f16/f32", found.dtype_ok, "other"),
        _check("finite", "no NaN/Inf", found.finite_ok, "NaN or Inf found"),
        _check("non-degenerate", "every layer varies", found.varied_ok, "a constant layer"),
        _check("token ids round-trip", "file token_ids == sent ids", found.ids_ok, "differ"),
        CheckRow(
            name="server chat rendering",
            expected="render endpoint ids == prepare_data ids",
            found=f"{len(render_problems) - len(bad_render)}/{len(render_problems)} equal"
            + (f"; {bad_render[0]}" if bad_render else ""),
            passed=not bad_render,
        ),
    ]
    if proof == SELF_CONSISTENCY:
        checks.append(_check("self-consistency", "two extractions bit-identical", found.repeat_ok, "differ"))
        return checks
    if found.matches:
        checks.append(convention_row(found.matches, layer_ids[-1]))
    else:  # nothing could be compared (bad shape or NaN): those rows fail already; this one must not pass
        checks.append(_check("layer-id convention", "each id nearest to its own layer", False, "not compared"))
    checks.append(error_row(found.errors, tolerance))
    return checks


def error_row(errors: dict[str, SlotError], tolerance: float) -> CheckRow:
    """Every id within tolerance of its own layer; on an MoE target, the tokens a near-tied routing explains excused
    (layer_match), at most MAX_EXCUSED_FRACTION of each id's tokens."""
    worst = max((e.max_rel for e in errors.values()), default=float("inf"))
    per_layer = json.dumps({k: round(e.max_rel, 4) for k, e in errors.items()})
    found = f"worst {worst:.4f} ({per_layer})"
    excused = {k: e for k, e in errors.items() if e.ambiguous}
    if excused:
        counts = ", ".join(f"id {k}: {e.excused}/{e.tokens} (max {e.raw_max_rel:.4f})" for k, e in excused.items())
        found += f"; MoE tokens routed near a tie and excused: {counts}"
    too_many = [k for k, e in errors.items() if not e.excused_ok]
    if too_many:
        found += f"; MORE THAN {MAX_EXCUSED_FRACTION:.0%} excused at ids {too_many}: not a routing tie"
    expected = f"max rel error <= {tolerance} (MoE: near-tied routings excused, <= {MAX_EXCUSED_FRACTION:.0%})"
    passed = bool(errors) and worst <= tolerance and not too_many
    return CheckRow(name="vs HF fp32 reference", expected=expected, found=found, passed=passed)


def _check(name: str, expected: str, passed: bool, otherwise: str) -> CheckRow:
    """A row whose finding is "ok" when it passes, else `otherwise`."""
    return CheckRow(name=name, expected=expected, found="ok" if passed else otherwise, passed=passed)


SpecFactory = Callable[[str, list[int], str], Any]  # (model dir, layer ids, storage dir) -> the server's spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class CanaryRequest:
    """One canary run: the target and the prepared samples to send it, how its server starts, and what passes."""

    target_dir: Path
    work_dir: Path  # scratch: the slice, its files and the server's storage, removed afterwards
    samples: list[Sample]
    messages: list[list[dict[str, str]]]  # each sample's conversation, for the server chat rendering check
    spec_factory: SpecFactory
    server_log: Path
    device: str
    client: ClientSettings
    tolerance: float  # the largest relative error of a captured id against its HF reference layer
    render_samples: int  # how many samples' conversations the server renders (== prepare_data's ids)
    canary_layers: int | None  # None: as few as cover every layer type (canary_layer_count)
    trust_remote_code: bool  # target.trust_remote_code (its default is the schema's)
    reference: Literal["hf_fp32", "self_consistency"] = HF_FP32  # canary.reference: which proof runs
    reference_device: str  # reference.device: where the hf_fp32 reference's layers run


def run_canary(request: CanaryRequest) -> CanaryReport:
    target = read_target_config(request.target_dir)
    layers = canary_layer_count(target.text, request.canary_layers)
    piece = CanarySlice(request.work_dir / "model", layers, canary_layer_ids(layers), target.hidden_size)
    try:
        return _run_on_slice(request, piece)
    finally:
        # the slice is scratch (a few GB on a real model): gone on success, failure and SIGTERM alike
        shutil.rmtree(piece.model_dir, ignore_errors=True)
        shutil.rmtree(request.work_dir / "scratch", ignore_errors=True)


def _run_on_slice(request: CanaryRequest, piece: CanarySlice) -> CanaryReport:
    build_truncated_target(request.target_dir, piece.model_dir, piece.layers)
    work, samples = request.work_dir, request.samples
    files, repeat, scratch = piece.files(work / "files"), piece.files(work / "files_repeat"), work / "scratch"
    for d in (files.folder, repeat.folder, scratch):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    proof = request.reference
    if proof == SELF_CONSISTENCY:
        log.warning("canary: %s", REFERENCE_NOTES[proof])
    log.info("canary: %d-layer slice, capturing ids %s, proof %s", piece.layers, piece.layer_ids, proof)
    spec = request.spec_factory(str(piece.model_dir), piece.layer_ids, str(scratch.resolve()))
    opened = opening_reference(piece, proof, trust_remote_code=request.trust_remote_code)
    with VLLMServer(spec, request.server_log) as server:
        ready_s = server.ready_s
        for into in [files, repeat] if proof == SELF_CONSISTENCY else [files]:
            tracker = ProgressTracker(None, 0, len(samples), 0)
            extract_samples(server, samples, into, settings=request.client, tracker=tracker)
        render_problems = [
            (i, render_check(server, request.messages[i], samples[i].input_ids))
            for i in range(min(request.render_samples, len(samples)))
        ]
    found = inspect_files(samples, piece, proof, files_dir=files.folder, repeat_dir=repeat.folder,
                          tolerance=request.tolerance, trust_remote_code=request.trust_remote_code,
                          opened=opened, reference_device=request.reference_device)  # fmt: skip
    checks = build_checks(found, piece, render_problems, tolerance=request.tolerance, proof=proof)
    return CanaryReport(
        passed=all(c.passed for c in checks),
        device=request.device,
        canary_layers=piece.layers,
        canary_layer_ids=piece.layer_ids,
        proof=proof,
        reference=REFERENCE_NOTES[proof],
        reference_device=request.reference_device,
        tolerance=request.tolerance,
        per_layer_max_rel_error=found.max_rel,
        per_layer_mean_rel_error=found.mean_rel,
        per_layer_ambiguous_tokens={k: e.ambiguous for k, e in found.errors.items()},
        per_layer_excused_tokens={k: e.excused for k, e in found.errors.items()},
        samples=len(samples),
        server_ready_s=round(ready_s, 2),
        checks=checks,
        layer_matches={
            str(m.claimed): LayerMatch(**dataclasses.asdict(m), margin=round(m.margin, 3)) for m in found.matches
        },
    )


def opening_reference(piece: CanarySlice, proof: str, *, trust_remote_code: bool) -> Callable[[], Target] | None:
    """hf_fp32: the slice's fp32 reference skeleton (open_target: transformers' import and the model built on the
    meta device, ~2-3 s of one core on the tiny target) built in a thread while the server starts, which keeps its
    own processes busy on the other cores. The call returns it, or raises what open_target raised. A daemon thread:
    a stage stopped meanwhile does not wait for it."""
    if proof != HF_FP32:
        return None
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["target"] = open_target(piece.model_dir, trust_remote_code=trust_remote_code)
        except BaseException as exc:  # noqa: BLE001 - raised in the stage's thread by opened()
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="canary-reference", daemon=True)
    thread.start()

    def opened() -> Target:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["target"]

    return opened


def pick_samples(prepared_dir: Path, count: int, max_tokens: int) -> tuple[list[Sample], list[list[dict]]]:
    """The first `count` prepared rows (truncated to max_tokens) and their conversations."""
    dataset = open_prepared(prepared_dir)
    samples, messages = [], []
    for row in range(min(count, len(dataset))):
        ids = [int(t) for t in dataset[row]["input_ids"]][:max_tokens]
        samples.append(Sample(row, ids))
        messages.append(json.loads(dataset[row]["messages"]))
    return samples, messages


def server_spec_factory(settings: CanaryStage, device: str) -> SpecFactory:
    """The extraction server for the slice: the same builder extraction uses, with the render endpoint on."""
    from eagle3_workflow.serving.engine import hidden_states_server_spec

    def spec_factory(model: str, layer_ids: list[int], storage_dir: str):
        return hidden_states_server_spec(settings, model=model, layer_ids=layer_ids, storage_dir=storage_dir,
                                         device=device, enable_render_endpoint=True)  # fmt: skip

    return spec_factory


def client_settings(extraction: ExtractionStall) -> ClientSettings:
    """The canary's client: a few samples, few retries; the stall limit is extraction's."""
    return ClientSettings(
        concurrency=4,
        request_timeout_s=300,
        max_retries=1,
        progress_interval_s=5,
        fail_after_samples=None,
        stall_timeout_s=extraction.stall_timeout_s,
        stall_factor=extraction.stall_factor,
    )


def refuse_or_log(report: CanaryReport, log: logging.Logger) -> None:
    """A failed canary stops the run with its table; a passed one logs it."""
    table = check_table(report.checks)
    if not report.passed:
        raise StageError(
            f"canary FAILED on a slice of {report.canary_layers} layers of the target (ids "
            f"{report.canary_layer_ids}); extraction will not start:\n{table}\nproof: {report.proof}, reference: "
            f"{report.reference}"
        )
    log.info(
        "canary passed (proof %s: %s, %d layers, server ready in %.1f s):\n%s",
        report.proof,
        report.reference,
        report.canary_layers,
        report.server_ready_s,
        table,
    )
