"""Stage `canary`: the production extraction path on a few-layer slice of the real checkpoint.

1. Truncate (slice.py): same config with K layers (every distinct layer type covered, e.g. DeepSeek-V3/Kimi's dense
   layers plus the first MoE layer, and at least 8 so the id set can have production's shape), reading only
   the needed tensors lazily from the safetensors shards.
2. Serve it exactly as extraction does (same spec builder, connector, tensor-parallel size, client code) and
   extract a handful of prepared samples, capturing ids shaped like production's [2, N//2, N-3, N]:
   [2, K//2, K-2, K] (gaps between all ids, last = K). A contiguous 1..K set would hide any remap that keeps
   the number of ids (issue 13: id k taken from layer k+1 whenever k+1 < N).
3. Compare with an independent HF transformers forward in fp32 using the documented convention (id k < K =
   output_hidden_states[k], id K = pre-norm output of the last layer), computed for EVERY layer 0..K plus the
   post-norm output. Each captured slot is matched to the reference it is nearest to (distance summed over
   all tokens of all samples); the `layer-id convention` row fails, naming the layer, when that is not the
   id the slot claims. Shift, swap, one layer for all ids, post-norm for K: all are a wrong nearest layer.
   The margin to the runner-up is recorded (adjacent layers of a tiny random model can be close).
4. Also: shapes [T, L, H], dtype, finite, non-degenerate, token ids round-trip, and the server's chat rendering
   (render endpoint) equals prepare_data's ids.
Where HF cannot run the checkpoint, the artefact says so and self-consistency (two extractions equal) is
checked instead; it never passes silently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagle3_workflow.artefacts import CanaryReport, CheckRow, LayerMatch
from eagle3_workflow.canary.slice import CanarySlice, build_truncated_target, canary_layer_count, canary_layer_ids
from eagle3_workflow.errors import StageError, check_table
from eagle3_workflow.extraction_client import ClientSettings, ProgressTracker, Sample, extract_samples
from eagle3_workflow.hidden_states import read_hidden_states, read_sample
from eagle3_workflow.layer_match import POST_NORM, SlotMatch, compare_layers, match_slots, squared_distances
from eagle3_workflow.prepared import open_prepared
from eagle3_workflow.settings import CanaryStage, ExtractionStall
from eagle3_workflow.target_config import read_target_config
from eagle3_workflow.vllm_server import VLLMServer

log = logging.getLogger("eagle3.canary")


def reference_all_layers(input_ids: list[int], model: Any) -> tuple[list[str], torch.Tensor]:
    """HF fp32 forward; every candidate source in vLLM's convention: labels and [T, K + 2, H].

    Label str(k) for k in 0..K-1 is HF ``output_hidden_states[k]`` (the input of layer k), "K" is the pre-norm
    output of the last layer, "post-norm" the final norm's output (HF ``hidden_states[-1]``). All of them, not
    only the claimed ids, so a slot filled from any layer is named.
    """
    captured: dict[str, torch.Tensor] = {}
    layers = model.model.layers

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = layers[-1].register_forward_hook(hook)
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    num_layers = len(layers)
    states = [out.hidden_states[k][0] for k in range(num_layers)]
    states += [captured["last"][0], out.hidden_states[num_layers][0]]
    labels = [str(k) for k in range(num_layers + 1)] + [POST_NORM]
    return labels, torch.stack([s.float() for s in states], dim=1)


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


def load_hf_reference(model_dir: Path, trust_remote_code: bool) -> tuple[Any, str]:
    """The fp32 HF model, or None and why (e.g. a quantization HF cannot run: self-consistency instead)."""
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code
        ).eval()
    except Exception as exc:  # noqa: BLE001 - recorded in the artefact, the fallback check runs instead
        note = f"no HF reference ({repr(exc)[:300]}); self-consistency: two extractions must be equal"
        log.warning("canary: %s", note)
        return None, note
    return model, "HF transformers fp32 forward"


@dataclasses.dataclass
class FileFindings:
    shape_ok: bool = True
    dtype_ok: bool = True
    finite_ok: bool = True
    varied_ok: bool = True
    ids_ok: bool = True
    repeat_ok: bool = True
    max_rel: dict[str, float] = dataclasses.field(default_factory=dict)
    mean_rel: dict[str, float] = dataclasses.field(default_factory=dict)
    matches: list[SlotMatch] = dataclasses.field(default_factory=list)


def inspect_files(
    samples: list[Sample], piece: CanarySlice, hf_model: Any, *, files_dir: Path, repeat_dir: Path
) -> FileFindings:
    """Read every extracted file once: format checks, and against the HF reference of every layer."""
    layer_ids = piece.layer_ids
    found = FileFindings()
    labels: list[str] = []
    sq_dist = sq_norm = None
    for sample in samples:
        hidden, token_ids = read_sample(files_dir, sample.row)
        found.shape_ok &= list(hidden.shape) == [len(sample.input_ids), len(layer_ids), piece.hidden_size]
        found.dtype_ok &= hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
        found.finite_ok &= bool(torch.isfinite(hidden).all())
        found.varied_ok &= all(float(hidden[:, j].float().std()) > 0 for j in range(hidden.shape[1]))
        found.ids_ok &= token_ids.tolist() == sample.input_ids
        if hf_model is None:
            found.repeat_ok &= torch.equal(read_hidden_states(repeat_dir, sample.row), hidden)
            continue
        if not (found.finite_ok and found.shape_ok):
            continue
        labels, candidates = reference_all_layers(sample.input_ids, hf_model)
        own = candidates[:, [labels.index(str(i)) for i in layer_ids]]
        sample_max, sample_mean = compare_layers(hidden, own, layer_ids)
        for key in sample_max:
            found.max_rel[key] = max(found.max_rel.get(key, 0.0), sample_max[key])
            found.mean_rel[key] = max(found.mean_rel.get(key, 0.0), sample_mean[key])
        dist = squared_distances(hidden, candidates)
        norm = hidden.float().pow(2).sum(dim=(0, 2))
        sq_dist = dist if sq_dist is None else sq_dist + dist
        sq_norm = norm if sq_norm is None else sq_norm + norm
    if sq_dist is not None:
        found.matches = match_slots(layer_ids, labels, sq_dist, sq_norm)
    return found


def build_checks(
    found: FileFindings,
    piece: CanarySlice,
    render_problems: list[tuple[int, str | None]],
    *,
    tolerance: float,
    with_reference: bool,
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
    if not with_reference:
        checks.append(_check("self-consistency", "two extractions bit-identical", found.repeat_ok, "differ"))
        return checks
    if found.matches:
        checks.append(convention_row(found.matches, layer_ids[-1]))
    else:  # nothing could be compared (bad shape or NaN): those rows fail already; this one must not pass
        checks.append(_check("layer-id convention", "each id nearest to its own layer", False, "not compared"))
    worst = max(found.max_rel.values()) if found.max_rel else float("inf")
    per_layer = json.dumps({k: round(v, 4) for k, v in found.max_rel.items()})
    checks.append(
        CheckRow(
            name="vs HF fp32 reference",
            expected=f"max rel error <= {tolerance}",
            found=f"worst {worst:.4f} ({per_layer})",
            passed=worst <= tolerance,
        )
    )
    return checks


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
    hf_model, reference_note = load_hf_reference(piece.model_dir, request.trust_remote_code)
    log.info("canary: %d-layer slice, capturing ids %s", piece.layers, piece.layer_ids)
    spec = request.spec_factory(str(piece.model_dir), piece.layer_ids, str(scratch.resolve()))
    with VLLMServer(spec, request.server_log) as server:
        ready_s = server.ready_s
        for into in [files] if hf_model is not None else [files, repeat]:
            tracker = ProgressTracker(None, 0, len(samples), 0)
            extract_samples(server, samples, into, settings=request.client, tracker=tracker)
        render_problems = [
            (i, render_check(server, request.messages[i], samples[i].input_ids))
            for i in range(min(request.render_samples, len(samples)))
        ]
    found = inspect_files(samples, piece, hf_model, files_dir=files.folder, repeat_dir=repeat.folder)
    checks = build_checks(
        found, piece, render_problems, tolerance=request.tolerance, with_reference=hf_model is not None
    )
    return CanaryReport(
        passed=all(c.passed for c in checks),
        device=request.device,
        canary_layers=piece.layers,
        canary_layer_ids=piece.layer_ids,
        reference=reference_note,
        tolerance=request.tolerance,
        per_layer_max_rel_error=found.max_rel,
        per_layer_mean_rel_error=found.mean_rel,
        samples=len(samples),
        server_ready_s=round(ready_s, 2),
        checks=checks,
        layer_matches={
            str(m.claimed): LayerMatch(**dataclasses.asdict(m), margin=round(m.margin, 3)) for m in found.matches
        },
    )


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
    from eagle3_workflow.vllm_server import hidden_states_server_spec

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
            f"{report.canary_layer_ids}); extraction will not start:\n{table}\nreference: {report.reference}"
        )
    log.info(
        "canary passed (%s, %d layers, server ready in %.1f s):\n%s",
        report.reference,
        report.canary_layers,
        report.server_ready_s,
        table,
    )
