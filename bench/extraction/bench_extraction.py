"""Extraction throughput against plain vLLM prefill, side by side in one run.

For a preset whose run already has prepared data, a target and passed gates (run
`snakemake --until canary --configfile PRESET` first), it measures on the same samples, with the same
client concurrency and the same vLLM engine settings:
  plain    : a vLLM server without the hidden-states method, 1-token completions (prefill only)
  workflow : the extract_hidden_states stage's own code path (server with extract_hidden_states + connector,
             client, file checks, atomic renames); the clock stops when the last file is on disk
and prints tokens/s of each and the ratio workflow / plain (goal >= 0.95). Each mode runs `--repeats` times,
alternating, and the best of each is compared (server start-up is excluded from both).

usage: .venv/bin/python bench/extraction/bench_extraction.py config/presets/tiny.yaml [--repeats 2] [--samples N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica  # noqa: E402
from eagle3_workflow.files.artefacts import load  # noqa: E402
from eagle3_workflow.files.hidden_states import HiddenStateFiles  # noqa: E402
from eagle3_workflow.files.prepared import open_prepared, read_input_ids  # noqa: E402
from eagle3_workflow.files.target_artefacts import ApiCompatReport  # noqa: E402
from eagle3_workflow.serving.engine import ServerSpec, hidden_states_server_spec  # noqa: E402
from eagle3_workflow.serving.server import VLLMServer  # noqa: E402
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage  # noqa: E402
from eagle3_workflow.settings.views import view_of  # noqa: E402


def finished_run(preset: Path) -> tuple[dict, ApiCompatReport, str, Path]:
    """The preset's validated config, its run's check_api report, target and prepared data (the run must exist)."""
    config = validated_config(preset)
    run_dir = REPO / "results" / config["run"]
    api = load(ApiCompatReport, run_dir / "checks" / "api_compat.json")
    return config, api, config["target"]["path"] or str(run_dir / "target"), run_dir / "data" / "prepared"


def validated_config(path: Path) -> dict:
    from snakemake.utils import validate

    config = yaml.safe_load(path.read_text())
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


async def plain_prefill(server: VLLMServer, prompts: list[list[int]], concurrency: int) -> float:
    import httpx

    semaphore = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        async with semaphore:
            response = await client.post(
                f"{server.base_url}/v1/completions",
                headers=server.headers(),
                timeout=600,
                json={"model": server.spec.served_model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0},
            )
            response.raise_for_status()

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.monotonic()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=None, help="use the first N prepared samples")
    args = parser.parse_args()
    config, api, target, prepared = finished_run(args.preset)
    all_ids = read_input_ids(prepared)
    count = min(args.samples or len(all_ids), len(all_ids))
    prompts = all_ids[:count]
    tokens = sum(map(len, prompts))
    # the extraction stage's settings, as its rule passes them
    stage = view_of(ExtractHiddenStatesStage, config)
    device = api.device
    work = Path(tempfile.mkdtemp(prefix="bench-extraction-"))
    subset = work / "prepared"
    open_prepared(prepared).select(range(count)).save_to_disk(str(subset))  # extraction reads only input_ids

    def extraction_spec(storage_dir: str) -> ServerSpec:
        return hidden_states_server_spec(
            stage,
            model=target,
            layer_ids=api.layer_ids,
            storage_dir=storage_dir,
            device=device,
            enable_render_endpoint=False,
        )

    plain_spec = extraction_spec(str(work / "unused"))
    plain_spec.speculative_config = None
    plain_spec.kv_transfer_config = None
    results: dict[str, list[float]] = {"plain": [], "workflow": []}
    bytes_written = 0
    with VLLMServer(plain_spec, work / "plain-server.log") as server:
        asyncio.run(plain_prefill(server, prompts[:8], stage.extraction.concurrency))  # warm-up
        for _ in range(args.repeats):
            results["plain"].append(tokens / asyncio.run(plain_prefill(server, prompts, stage.extraction.concurrency)))
    for repeat in range(args.repeats):
        files = work / f"files-{repeat}"
        request = ReplicaRequest(
            prepared_dir=subset,
            replica=0,
            replicas=1,
            files=HiddenStateFiles(files, len(api.layer_ids), api.target.hidden_size),
            scratch_dir=work / f"scratch-{repeat}",
            server_spec_factory=extraction_spec,
            server_log=work / "extract-server.log",
            disk_margin=1.0,
        )
        manifest = extract_replica(request, client_settings(stage.extraction))
        results["workflow"].append(manifest.tokens_per_s)
        bytes_written = manifest.bytes_written
        shutil.rmtree(files)
    best_plain, best_workflow = max(results["plain"]), max(results["workflow"])
    summary = {
        "preset": str(args.preset),
        "device": device,
        "host": platform.node(),
        "samples": count,
        "tokens": tokens,
        "layers_captured": api.layer_ids,
        "hidden_size": api.target.hidden_size,
        "plain_tok_per_s": [round(x, 1) for x in results["plain"]],
        "workflow_tok_per_s": [round(x, 1) for x in results["workflow"]],
        "ratio_best": round(best_workflow / best_plain, 3),
        "bytes_per_run": bytes_written,
        "workflow_bytes_per_s": round(bytes_written * best_workflow / tokens, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(summary, indent=2))
    print(f"RATIO workflow/plain = {summary['ratio_best']:.3f} (goal >= 0.95)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
