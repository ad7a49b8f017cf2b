"""Stage `canary`: the production extraction path on a few-layer slice of the real checkpoint.

1. Truncate: same config with K layers (enough to cover every distinct layer type: for DeepSeek-V3/Kimi the
   dense layers plus the first MoE layer), reading only the needed tensors lazily from the safetensors shards.
2. Serve it exactly as extraction does (same spec builder, connector, tensor-parallel size, client code) and
   extract a handful of prepared samples, capturing every layer id 1..K.
3. Compare with an independent HF transformers forward in fp32 using the documented convention (id k < K =
   output_hidden_states[k], id K = pre-norm output of the last layer). Besides the error against the
   tolerance, each id must match its own reference better than any other layer's: a shifted capture fails
   even where consecutive layers are similar.
4. Also: shapes [T, L, H], dtype, finite, non-degenerate, token ids round-trip, and the server's chat rendering
   (render endpoint) equals prepare_data's ids.
Where HF cannot run the checkpoint, the artefact says so and self-consistency (two extractions equal) is
checked instead; it never passes silently.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3_workflow.contracts import CanaryReport, CheckRow, check_table, read_json, write_json_atomic
from eagle3_workflow.errors import StageError
from eagle3_workflow.extraction import ClientSettings, ProgressTracker, Sample, extract_samples
from eagle3_workflow.hidden_states import hs_file
from eagle3_workflow.vllm_server import VLLMServer

log = logging.getLogger("eagle3.canary")

LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


def canary_layer_count(config: dict[str, Any], requested: int | None) -> int:
    """Layers to keep: every distinct layer type covered, at least 3 (so ids 1..K include a mid layer)."""
    text = config.get("text_config") or config
    total = int(text["num_hidden_layers"])
    if requested:
        return min(requested, total)
    needed = 3
    dense = text.get("first_k_dense_replace")
    if dense is not None:
        needed = max(needed, int(dense) + 1)  # the dense layers plus the first MoE layer
    layer_types = text.get("layer_types")
    if layer_types:
        first_seen: dict[str, int] = {}
        for i, kind in enumerate(layer_types):
            first_seen.setdefault(str(kind), i)
        needed = max(needed, max(first_seen.values()) + 1)
    return min(needed, total)


def truncated_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    out = json.loads(json.dumps(config))
    text = out.get("text_config") or out
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    text.pop("num_nextn_predict_layers", None)  # MTP layers are not part of the slice
    return out


def keep_tensor(name: str, layers: int) -> bool:
    match = LAYER_KEY.search(name)
    return match is None or int(match.group(2)) < layers


def build_truncated_target(target_dir: Path, out_dir: Path, layers: int) -> dict[str, Any]:
    """Write a K-layer copy of the checkpoint, reading only the kept tensors (lazy safe_open, sharded or not)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((target_dir / "config.json").read_text())
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        by_file: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if keep_tensor(name, layers):
                by_file.setdefault(shard, []).append(name)
    else:
        single = target_dir / "model.safetensors"
        if not single.exists():
            raise StageError(
                f"{target_dir} has neither model.safetensors nor model.safetensors.index.json; the "
                "canary reads safetensors checkpoints only"
            )
        with safe_open(str(single), framework="pt") as handle:
            by_file = {"model.safetensors": [n for n in handle.keys() if keep_tensor(n, layers)]}
    tensors: dict[str, torch.Tensor] = {}
    for shard, names in by_file.items():
        with safe_open(str(target_dir / shard), framework="pt") as handle:
            for name in names:
                tensors[name] = handle.get_tensor(name)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(truncated_config(config, layers), indent=2))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy2(target_dir / name, out_dir / name)
    for extra in target_dir.glob("*.py"):  # remote-code modules (used only when trust_remote_code is set)
        shutil.copy2(extra, out_dir / extra.name)
    log.info(
        "canary target: %d of %d layers, %d tensors -> %s",
        layers,
        int((config.get("text_config") or config)["num_hidden_layers"]),
        len(tensors),
        out_dir,
    )
    return config


def reference_hidden_states(
    model_dir: Path, input_ids: list[int], layer_ids: list[int], trust_remote_code: bool, model: Any = None
) -> torch.Tensor:
    """HF fp32 forward in vLLM's convention: [T, L, H]."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code
        ).eval()
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
    columns = []
    for layer_id in layer_ids:
        state = captured["last"] if layer_id == num_layers else out.hidden_states[layer_id]
        columns.append(state[0].float())
    return torch.stack(columns, dim=1)


def compare_layers(
    extracted: torch.Tensor, reference: torch.Tensor, layer_ids: list[int]
) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """Per id: max error / max |ref|, mean error / mean |ref|, and which reference id it matches best."""
    max_rel, mean_rel, best = {}, {}, {}
    for j, layer_id in enumerate(layer_ids):
        got = extracted[:, j].float()
        ref = reference[:, j].float()
        diff = (got - ref).abs()
        max_rel[str(layer_id)] = float(diff.max() / ref.abs().max().clamp_min(1e-12))
        mean_rel[str(layer_id)] = float(diff.mean() / ref.abs().mean().clamp_min(1e-12))
        distances = [float((got - reference[:, k].float()).abs().mean()) for k in range(len(layer_ids))]
        best[str(layer_id)] = layer_ids[min(range(len(layer_ids)), key=distances.__getitem__)]
    return max_rel, mean_rel, best


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


def run_canary(
    *,
    target_dir: Path,
    work_dir: Path,
    samples: list[Sample],
    messages: list[list[dict[str, str]]],
    spec_factory: Any,
    server_log: Path,
    canary_layers: int | None,
    tolerance: float,
    render_samples: int,
    trust_remote_code: bool,
    device: str,
) -> CanaryReport:
    config = json.loads((target_dir / "config.json").read_text())
    layers = canary_layer_count(config, canary_layers)
    layer_ids = list(range(1, layers + 1))
    canary_model = work_dir / "model"
    build_truncated_target(target_dir, canary_model, layers)
    hidden_size = int((config.get("text_config") or config)["hidden_size"])
    files_dir, second_dir, scratch = work_dir / "files", work_dir / "files_repeat", work_dir / "scratch"
    for d in (files_dir, second_dir, scratch):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    checks: list[CheckRow] = []
    reference_note = "HF transformers fp32 forward"
    hf_model, hf_error = None, None
    try:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            canary_model, dtype=torch.float32, trust_remote_code=trust_remote_code
        ).eval()
    except Exception as exc:  # noqa: BLE001 - e.g. a quantization HF cannot run: recorded, fallback below
        hf_error = repr(exc)
        reference_note = f"no HF reference ({hf_error[:300]}); self-consistency: two extractions must be equal"
        log.warning("canary: %s", reference_note)

    settings = ClientSettings(concurrency=4, request_timeout_s=300, max_retries=1, progress_interval_s=5)
    with VLLMServer(spec_factory(str(canary_model), layer_ids, str(scratch.resolve())), server_log) as server:
        ready_s = server.ready_s
        extract_samples(
            server,
            samples,
            files_dir,
            layer_count=len(layer_ids),
            hidden_size=hidden_size,
            settings=settings,
            tracker=ProgressTracker(None, 0, len(samples), 0),
        )
        if hf_model is None:
            extract_samples(
                server,
                samples,
                second_dir,
                layer_count=len(layer_ids),
                hidden_size=hidden_size,
                settings=settings,
                tracker=ProgressTracker(None, 0, len(samples), 0),
            )
        render_problems = [
            (i, render_check(server, messages[i], samples[i].input_ids))
            for i in range(min(render_samples, len(samples)))
        ]

    from safetensors.torch import load_file

    max_rel: dict[str, float] = {}
    mean_rel: dict[str, float] = {}
    shape_ok = dtype_ok = finite_ok = varied_ok = ids_ok = convention_ok = repeat_ok = True
    convention_found: dict[str, int] = {}
    for sample in samples:
        data = load_file(str(hs_file(files_dir, sample.row)))
        hidden, token_ids = data["hidden_states"], data["token_ids"]
        shape_ok &= list(hidden.shape) == [len(sample.input_ids), len(layer_ids), hidden_size]
        dtype_ok &= hidden.dtype in (torch.bfloat16, torch.float16, torch.float32)
        finite_ok &= bool(torch.isfinite(hidden).all())
        varied_ok &= all(float(hidden[:, j].float().std()) > 0 for j in range(len(layer_ids)))
        ids_ok &= token_ids.tolist() == sample.input_ids
        if hf_model is not None and finite_ok and shape_ok:
            reference = reference_hidden_states(
                canary_model, sample.input_ids, layer_ids, trust_remote_code, model=hf_model
            )
            sample_max, sample_mean, best = compare_layers(hidden, reference, layer_ids)
            for key in sample_max:
                max_rel[key] = max(max_rel.get(key, 0.0), sample_max[key])
                mean_rel[key] = max(mean_rel.get(key, 0.0), sample_mean[key])
            for key, matched in best.items():
                if int(key) != matched:
                    convention_ok = False
                    convention_found[key] = matched
        if hf_model is None:
            again = load_file(str(hs_file(second_dir, sample.row)))["hidden_states"]
            repeat_ok &= torch.equal(again, hidden)

    checks.append(
        CheckRow("shape [T, L, H]", f"[T, {len(layer_ids)}, {hidden_size}]", "ok" if shape_ok else "mismatch", shape_ok)
    )
    checks.append(CheckRow("dtype", "bf16/f16/f32", "ok" if dtype_ok else "other", dtype_ok))
    checks.append(CheckRow("finite", "no NaN/Inf", "ok" if finite_ok else "NaN or Inf found", finite_ok))
    checks.append(
        CheckRow("non-degenerate", "every layer varies", "ok" if varied_ok else "a constant layer", varied_ok)
    )
    checks.append(CheckRow("token ids round-trip", "file token_ids == sent ids", "ok" if ids_ok else "differ", ids_ok))
    bad_render = [f"sample {i}: {p}" for i, p in render_problems if p]
    checks.append(
        CheckRow(
            "server chat rendering",
            "render endpoint ids == prepare_data ids",
            f"{len(render_problems) - len(bad_render)}/{len(render_problems)} equal"
            + (f"; {bad_render[0]}" if bad_render else ""),
            not bad_render,
        )
    )
    if hf_model is not None:
        worst = max(max_rel.values()) if max_rel else float("inf")
        checks.append(
            CheckRow(
                "layer-id convention",
                "id k matches reference k best",
                "ok" if convention_ok else f"id -> best match {convention_found}",
                convention_ok,
            )
        )
        checks.append(
            CheckRow(
                "vs HF fp32 reference",
                f"max rel error <= {tolerance}",
                f"worst {worst:.4f} ({json.dumps({k: round(v, 4) for k, v in max_rel.items()})})",
                worst <= tolerance,
            )
        )
    else:
        checks.append(
            CheckRow("self-consistency", "two extractions bit-identical", "equal" if repeat_ok else "differ", repeat_ok)
        )
    return CanaryReport(
        passed=all(c.passed for c in checks),
        device=device,
        canary_layers=layers,
        canary_layer_ids=layer_ids,
        reference=reference_note,
        tolerance=tolerance,
        per_layer_max_rel_error=max_rel,
        per_layer_mean_rel_error=mean_rel,
        samples=len(samples),
        server_ready_s=round(ready_s, 2),
        checks=checks,
    )


def pick_samples(prepared_dir: Path, count: int, max_tokens: int) -> tuple[list[Sample], list[list[dict]]]:
    """The first `count` prepared rows (truncated to max_tokens) and their conversations."""
    import datasets

    dataset = datasets.load_from_disk(str(prepared_dir)).with_format(None)
    samples, messages = [], []
    for row in range(min(count, len(dataset))):
        ids = [int(t) for t in dataset[row]["input_ids"]][:max_tokens]
        samples.append(Sample(row, ids))
        messages.append(json.loads(dataset[row]["messages"]))
    return samples, messages


def main(snakemake: Any) -> None:
    from eagle3_workflow.errors import run_stage
    from eagle3_workflow.gpu_placement import holding_gpus
    from eagle3_workflow.vllm_server import hidden_states_server_spec

    @holding_gpus(snakemake)
    def body(log: logging.Logger) -> None:
        config = snakemake.config
        api = read_json(snakemake.input.api_compat)
        if not api.get("passed"):
            raise StageError("api_compat.json says passed=false; the canary will not start")
        canary_cfg = config["canary"]
        device = api["device"]
        tp = config["extraction"]["tensor_parallel_size"] if device == "cuda" else 1

        def spec_factory(model: str, layer_ids: list[int], storage_dir: str):
            return hidden_states_server_spec(
                config["vllm"],
                model=model,
                layer_ids=layer_ids,
                storage_dir=storage_dir,
                device=device,
                tensor_parallel_size=tp,
                trust_remote_code=config["target"]["trust_remote_code"],
                dtype=config["target"]["dtype"],
                enable_render_endpoint=True,
            )

        samples, messages = pick_samples(
            Path(snakemake.input.prepared), canary_cfg["num_samples"], canary_cfg["max_tokens_per_sample"]
        )
        report = run_canary(
            target_dir=Path(snakemake.input.target),
            work_dir=Path(snakemake.params.work_dir),
            samples=samples,
            messages=messages,
            spec_factory=spec_factory,
            server_log=Path(snakemake.log[0]),
            canary_layers=canary_cfg["num_layers"],
            tolerance=canary_cfg["relative_tolerance"],
            render_samples=canary_cfg["render_samples"],
            trust_remote_code=config["target"]["trust_remote_code"],
            device=device,
        )
        table = check_table(report.checks)
        if not report.passed:
            raise StageError(
                f"canary FAILED on a {report.canary_layers}-layer slice of the target; extraction will "
                f"not start:\n{table}\nreference: {report.reference}"
            )
        log.info(
            "canary passed (%s, %d layers, server ready in %.1f s):\n%s",
            report.reference,
            report.canary_layers,
            report.server_ready_s,
            table,
        )
        write_json_atomic(snakemake.output.report, report)

    run_stage("canary", snakemake.log[0], body)
