"""Side by side on one GPU: the workflow's extraction against plain vLLM prefill, and the workflow's train_draft
against bare `speculators train`, on the same data.

usage: python bench/gpu/bench_gpu.py --target DIR --work DIR [--samples 128] [--seq-len 2048] [--concurrency 64]
                                     [--repeats 3] [--eager] [--train-epochs 2] [--train-pairs 3] [--skip-steps 5]
                                     [--skip-train | --train-only | --train-on RUN_DIR] [--split-method]
                                     [--files-only] [--first-pair N] [--out FILE.json]

Data: --samples synthetic prompts of --seq-len random token ids of the target's tokenizer (all positions trained),
written in prepare_data's layout (a HF dataset saved to disk + token_freq.pt), so every stage function reads it as
it reads a real run's.

Extraction (tokens/s = prompt tokens / seconds; a server's start-up is never inside a clock):
  plain         a vLLM server without the hidden-states method, the same engine settings as the workflow's server
                (eagle3_workflow.serving.engine.hidden_states_server_spec minus speculative/kv-transfer config),
                1-token completions from an async HTTP client at --concurrency; pass 1 cold (right after ready,
                as the stage starts), then warm passes
  connector     the workflow's extraction server (extract_hidden_states + ExampleHiddenStatesConnector), the same
                raw client; the clock stops when the last file's writer lock is released (file complete on disk):
                what vLLM + its connector cost, without the workflow's client
  workflow      the same server (warm), eagle3_workflow.serving.extraction_client.extract_samples: the stage's client (waits for
                each file's lock, checks its header and token ids, renames it atomically)
  method        (only with --split-method: one more server start) the extraction server's spec without its KV
                connector: vLLM's extract_hidden_states method stores the layers' hidden states every step, nothing
                leaves the GPU; between plain and connector it splits the gap into the method's and the connector's
  stage         eagle3_workflow.extraction.replica.extract_replica: the whole stage function as the rule runs it (disk
                preflight, resume scan, own server, client, manifest); its manifest's tokens_per_s (cold)
                (only with --stage: one more server start)
Ratios: workflow / plain(warm), connector / plain(warm), workflow / connector (the client's own cost),
stage / plain(cold). Bytes/s = hidden-state bytes written / time. Verdict against the 0.98 goal (issue 42): --repeats
warm passes a side (3 by default), every workflow pass over every plain pass (extraction_verdict).

Training (same prepared data, same hidden-state files, same flags; flex attention, eager loss):
  bare          speculators' `speculators train` (cli.main(TrainConfig.resolve(argv))) through the workflow's trainer
                entry, which only adds a JSONL handler on its metric logger (and on CPU the shim's device patches);
                flags written out below
  workflow      eagle3_workflow.training.stage.train_draft (fingerprint, staging, vocab mapping, trainer subprocess with
                its output streamed line by line, checkpoint checks, publishing draft/)
Fairness: the first run of a process tree pays the cold kernel compilation (~92 s on the H200 for the 8B shape),
so one unmeasured warm-up run comes first, then --train-pairs pairs in alternating order (bare->workflow,
workflow->bare, ...). Each run is measured on its steady steps only (the trainer's logged step_ms after the first
--skip-steps): per side the median, min-max and IQR of steps/s, the ratio of medians (workflow / bare), each pair's
ratio, and the verdict against the 0.98 goal ("within noise" when the pair ratios straddle 1.0 or the goal). The
per-phase medians of speculators' profile (fetch/queue/h2d/fwd/bwd/clip/opt/step ms) are side by side, and every
run's per-step records are in the JSON.
--train-on results/<run>: the pairs on a finished pipeline run's rows (data/prepared, token_freq.pt) and hidden-state
files instead (made from --target; every file validated against its row), no extraction pass of the bench's own.
Each finished run is appended to --work/training-runs.jsonl; a later call with the same data, files and flags keeps
those runs and goes on with the plan (a device call is cut at 10 minutes; seven 8B-shape runs take longer). A run
in a resumed call pays a fresh process's compilation again, in its first steps, which --skip-steps leaves out.
Pairs across leases: each pair is measured within one lease (its two runs back to back on one machine), so pairs of
one key from several leases compare together (`training_pairs.py LEDGER LEDGER ...`). --files-only makes the files
with the workflow's server and client alone (one server start, no extraction figures), into the folder the full
bench's last pass uses, so the key is the same; --first-pair N numbers a lease's pairs from N (pair N runs bare first
when N is odd), after an earlier lease's pairs 1 ... N-1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import fcntl
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica  # noqa: E402
from eagle3_workflow.files.artefacts import load, write  # noqa: E402
from eagle3_workflow.files.draft_artefacts import TrainingSummary  # noqa: E402
from eagle3_workflow.files.hidden_states import HiddenStateFiles, resolve_layer_ids  # noqa: E402
from eagle3_workflow.files.target_artefacts import ApiCompatReport  # noqa: E402
from eagle3_workflow.files.writing import write_text_atomic  # noqa: E402
from eagle3_workflow.reference.target_config import read_target_config  # noqa: E402
from eagle3_workflow.serving.engine import hidden_states_server_spec  # noqa: E402
from eagle3_workflow.serving.extraction_client import ProgressTracker, Sample, extract_samples  # noqa: E402
from eagle3_workflow.serving.server import VLLMServer  # noqa: E402
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage  # noqa: E402
from eagle3_workflow.settings.views import view_of, with_schema_defaults  # noqa: E402


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# data


def write_synthetic_prepared(target: Path, out: Path, samples: int, seq_len: int, seed: int) -> list[list[int]]:
    """prepare_data's layout (eagle3_workflow.prepare.conversations.write_prepared) with random ids of the target's tokenizer."""
    import collections

    import datasets
    import torch
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(target)))
    rng = random.Random(seed)
    ids = [[rng.randrange(5, vocab) for _ in range(seq_len)] for _ in range(samples)]
    rows = {
        "input_ids": ids,
        "loss_mask": [[1] * seq_len for _ in ids],
        "seq_len": [seq_len] * samples,
        "messages": ["[]"] * samples,
        "origin": [f"synthetic:{i}" for i in range(samples)],
    }
    if out.exists():
        shutil.rmtree(out)
    dataset = datasets.Dataset.from_dict(rows)
    dataset.set_format("torch", columns=["input_ids", "loss_mask", "seq_len"], output_all_columns=True)
    dataset.save_to_disk(str(out / "prepared"))
    counts = collections.Counter(t for row in ids for t in row)
    torch.save(dict(counts), out / "token_freq.pt")
    return ids


# ---------------------------------------------------------------------------------------------------------------
# extraction


async def raw_pass(server: VLLMServer, prompts: list[list[int]], concurrency: int, wait_files: bool) -> dict:
    """1-token completions; with wait_files, the clock stops when every file's writer lock is released."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    paths: list[str] = []

    def wait_lock(path: str) -> None:
        lock = path + ".lock"
        if os.path.exists(lock):
            with open(lock) as handle:
                fcntl.flock(handle, fcntl.LOCK_SH)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        async with semaphore:
            body = {"model": server.spec.served_model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
            response = await client.post(
                f"{server.base_url}/v1/completions", headers=server.headers(), json=body, timeout=600
            )
            response.raise_for_status()
            if wait_files:
                path = (response.json().get("kv_transfer_params") or {}).get("hidden_states_path")
                if not path:
                    raise RuntimeError(f"no hidden_states_path in {response.text[:300]}")
                paths.append(path)
                await asyncio.to_thread(wait_lock, path)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        seconds = time.monotonic() - start
    size = sum(os.path.getsize(p) for p in paths)
    for path in paths:
        for name in (path, path + ".lock"):
            if os.path.exists(name):
                os.unlink(name)
    tokens = sum(map(len, prompts))
    return {"seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1), "bytes": size}


def method_only_spec(extraction_spec):
    """The extraction server's spec with vLLM's `extract_hidden_states` method but no KV connector: the target's
    forward returns the chosen layers' hidden states and the method's cache-only layer stores them every step, but
    nothing is copied to the host or written. Between plain prefill and the extraction server, it tells the method's
    share of the gap from the connector's (the copy to the host and the file writes)."""
    return dataclasses.replace(extraction_spec, kv_transfer_config=None)


def method_only_passes(extraction_spec, prompts: list[list[int]], args: argparse.Namespace, work: Path) -> dict:
    """--split-method: a warm-up pass and --repeats warm passes on a method-only server. A server that does not
    start (vLLM may refuse the method without a connector) is recorded with its error, and the bench goes on."""
    log("method only: the extraction server's spec without its connector (extract_hidden_states, no files)")
    try:
        with VLLMServer(method_only_spec(extraction_spec), work / "method-server.log") as server:
            ready_s = round(server.ready_s, 1)
            asyncio.run(raw_pass(server, prompts[: min(8, len(prompts))], args.concurrency, wait_files=False))
            warm = [asyncio.run(raw_pass(server, prompts, args.concurrency, False)) for _ in range(args.repeats)]
    except Exception as error:  # noqa: BLE001 - a refused variant is a result, not the end of the bench
        log(f"method only: no server: {error!r} (log: {work / 'method-server.log'})")
        return {"error": repr(error)}
    log(f"method only: ready {ready_s} s, warm {[p['tok_per_s'] for p in warm]} tok/s")
    return {"ready_s": ready_s, "warm": warm}


class ExtractionSetup(NamedTuple):
    """What every extraction server of the bench shares: the layers and width of the target, the vLLM settings, the
    extraction stage's settings, and `spec(storage)`: the workflow's extraction server writing into `storage`."""

    layers: list[int]
    hidden: int
    vllm_settings: dict
    stage: ExtractHiddenStatesStage
    spec: Callable[[str], Any]


def extraction_setup(args: argparse.Namespace) -> ExtractionSetup:
    config = read_target_config(args.target)
    layers = resolve_layer_ids(config.num_layers, None)
    hidden = config.hidden_size
    vllm_settings = {
        "max_model_len": args.seq_len + 64,
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": args.eager,
        "kv_cache_memory_bytes": None,
        "gpu_memory_utilization": 0.85,
        "ready_timeout_s": 900,
        "cpu_threads": None,
        # every pass sends the same prompts: with vLLM's default prefix caching a second pass is served from
        # the cache (measured: 242k "tok/s" against 40k computed); off, every pass computes every token
        "extra_args": ["--no-enable-prefix-caching"],
    }
    if args.device == "cpu":
        vllm_settings |= {"kv_cache_memory_bytes": 1 << 30, "cpu_threads": 2, "enforce_eager": True}

    # the extraction stage's settings: the bench's vllm values and client, the schema's defaults for the rest
    extraction = {"tensor_parallel_size": 1, "concurrency": args.concurrency, "progress_interval_s": 10}
    stage = view_of(ExtractHiddenStatesStage, with_schema_defaults(vllm=vllm_settings, extraction=extraction))

    def spec(storage: str):
        return hidden_states_server_spec(
            stage,
            model=str(args.target),
            layer_ids=layers,
            storage_dir=storage,
            device=args.device,
            enable_render_endpoint=False,
        )

    return ExtractionSetup(layers, hidden, vllm_settings, stage, spec)


def workflow_files_dir(args: argparse.Namespace) -> Path:
    """Where the workflow client's last pass leaves its hidden-state files, which the training runs read: the same
    folder (and so the same training ledger key) whether a full extraction bench or --files-only made them."""
    return args.work / f"workflow-files-{args.repeats - 1}"


def extract_files_only(args: argparse.Namespace, prompts: list[list[int]], work: Path) -> dict:
    """--files-only: the workflow's extraction server and one pass of its client into workflow_files_dir, nothing
    measured beside it: the hidden-state files a later lease's training pairs need, for ~1 server start instead of
    the full bench's 2-3 (so that pair joins an earlier lease's pairs under the same ledger key)."""
    setup = extraction_setup(args)
    storage, files = work / "connector-scratch", workflow_files_dir(args)
    for folder in (storage, files):
        shutil.rmtree(folder, ignore_errors=True)
    storage.mkdir(parents=True)
    samples = [Sample(i, ids) for i, ids in enumerate(prompts)]
    log("files only: the workflow's extraction server and one pass of its client")
    with VLLMServer(setup.spec(str(storage.resolve())), work / "extract-server.log") as server:
        start = time.monotonic()
        written = extract_samples(server, samples, HiddenStateFiles(files, len(setup.layers), setup.hidden),
                                  settings=client_settings(setup.stage.extraction),
                                  tracker=ProgressTracker(None, 0, len(samples), 0))  # fmt: skip
        seconds = time.monotonic() - start
        ready_s = round(server.ready_s, 1)
    tokens = sum(map(len, prompts))
    result = {"extract_ready_s": ready_s, "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1),
              "bytes": written, "files_dir": str(files)}  # fmt: skip
    log(f"files only: ready {ready_s} s, {result['tok_per_s']} tok/s, {written} bytes -> {files}")
    return result


def bench_extraction(args: argparse.Namespace, prompts: list[list[int]], data_dir: Path, work: Path) -> dict:
    setup = extraction_setup(args)
    layers, hidden, stage, spec = setup.layers, setup.hidden, setup.stage, setup.spec
    vllm_settings = setup.vllm_settings
    tokens = sum(map(len, prompts))
    warm = prompts[: min(8, len(prompts))]
    result: dict = {"layers": layers, "hidden_size": hidden, "samples": len(prompts), "tokens": tokens}
    result["settings"] = vllm_settings | {"concurrency": args.concurrency}

    plain_spec = spec(str(work / "unused"))
    plain_spec.speculative_config = None
    plain_spec.kv_transfer_config = None
    log("plain: starting a vLLM server without the hidden-states method")
    with VLLMServer(plain_spec, work / "plain-server.log") as server:
        result["plain_ready_s"] = round(server.ready_s, 1)
        cold = asyncio.run(raw_pass(server, prompts, args.concurrency, wait_files=False))
        warm_passes = [asyncio.run(raw_pass(server, prompts, args.concurrency, False)) for _ in range(args.repeats)]
    result["plain_cold"] = cold
    result["plain_warm"] = warm_passes
    log(
        f"plain: ready {result['plain_ready_s']} s, cold {cold['tok_per_s']} tok/s, warm "
        f"{[p['tok_per_s'] for p in warm_passes]}"
    )

    if args.split_method:
        result["method"] = method_only_passes(spec(str(work / "unused")), prompts, args, work)

    storage = work / "connector-scratch"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    samples = [Sample(i, ids) for i, ids in enumerate(prompts)]
    log("extraction server (the workflow's spec): connector pass, then the workflow client")
    with VLLMServer(spec(str(storage.resolve())), work / "extract-server.log") as server:
        result["extract_ready_s"] = round(server.ready_s, 1)
        asyncio.run(raw_pass(server, warm, args.concurrency, wait_files=True))  # warm-up
        connector = [asyncio.run(raw_pass(server, prompts, args.concurrency, True)) for _ in range(args.repeats)]
        workflow = []
        for repeat in range(args.repeats):
            files = work / f"workflow-files-{repeat}"  # the last: workflow_files_dir
            shutil.rmtree(files, ignore_errors=True)
            settings = client_settings(stage.extraction)
            start = time.monotonic()
            written = extract_samples(
                server,
                samples,
                HiddenStateFiles(files, len(layers), hidden),
                settings=settings,
                tracker=ProgressTracker(None, 0, len(samples), 0),
            )
            seconds = time.monotonic() - start
            workflow.append({"seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 1), "bytes": written})
            if repeat < args.repeats - 1:
                shutil.rmtree(files)
    result["connector_warm"] = connector
    result["workflow_warm"] = workflow
    log(f"connector {[p['tok_per_s'] for p in connector]} tok/s, workflow client {[p['tok_per_s'] for p in workflow]}")

    best = {k: max(p["tok_per_s"] for p in result[k]) for k in ("plain_warm", "connector_warm", "workflow_warm")}
    result["ratios"] = {
        "workflow_vs_plain_warm": round(best["workflow_warm"] / best["plain_warm"], 3),
        "workflow_vs_plain_cold": round(best["workflow_warm"] / cold["tok_per_s"], 3),
        "connector_vs_plain_warm": round(best["connector_warm"] / best["plain_warm"], 3),
        "workflow_vs_connector": round(best["workflow_warm"] / best["connector_warm"], 3),
    }
    if result.get("method", {}).get("warm"):
        method_best = max(p["tok_per_s"] for p in result["method"]["warm"])
        result["ratios"]["method_vs_plain_warm"] = round(method_best / best["plain_warm"], 3)
        result["ratios"]["connector_vs_method_warm"] = round(best["connector_warm"] / method_best, 3)
    result["verdict"] = extraction_verdict([p["tok_per_s"] for p in warm_passes], [p["tok_per_s"] for p in workflow])
    bytes_per_run = workflow[-1]["bytes"]
    result["bytes_per_run"] = bytes_per_run
    result["workflow_bytes_per_s"] = round(bytes_per_run * best["workflow_warm"] / tokens, 1)
    result["connector_bytes_per_s"] = round(connector[-1]["bytes"] * best["connector_warm"] / tokens, 1)
    result["files_dir"] = str(workflow_files_dir(args))
    if not args.stage:
        return result
    log("stage: extract_replica (own server, cold, as the rule runs it)")
    stage_files = work / "stage-files"
    shutil.rmtree(stage_files, ignore_errors=True)
    request = ReplicaRequest(
        prepared_dir=data_dir / "prepared",
        replica=0,
        replicas=1,
        files=HiddenStateFiles(stage_files, len(layers), hidden),
        scratch_dir=work / "stage-scratch",
        server_spec_factory=spec,
        server_log=work / "stage-server.log",
        disk_margin=1.1,
        progress_path=work / "stage-progress.json",
    )
    manifest = extract_replica(request, client_settings(stage.extraction))
    result["stage"] = {
        "tok_per_s": manifest.tokens_per_s,
        "bytes": manifest.bytes_written,
        "server_ready_s": manifest.server_ready_s,
        "wall_s": manifest.wall_s,
    }
    shutil.rmtree(stage_files, ignore_errors=True)
    result["ratios"]["stage_vs_plain_cold"] = round(manifest.tokens_per_s / cold["tok_per_s"], 3)
    return result


# ---------------------------------------------------------------------------------------------------------------
# training


# The comparison is pure (plan, steady-state selection, statistics, verdict) so it is tested on CPU with
# synthetic step times; the adapters below only run processes and read their metric records.
SIDES = ("bare", "workflow")
PHASES = ("fetch_ms", "queue_ms", "h2d_ms", "fwd_ms", "bwd_ms", "clip_ms", "opt_ms", "step_ms")
TRAIN_GOAL = 0.98  # workflow steps/s over bare steps/s (issue 15)
EXTRACTION_GOAL = 0.98  # workflow tokens/s over plain prefill's, CUDA graphs on (issue 42)
MIN_PAIRS = 3  # fewer pairs give no spread worth a verdict
SKIP_STEPS = 5  # --skip-steps' default: logged steps holding compilation and the first fetches


def run_plan(pairs: int, warmup_side: str = "bare", first_pair: int = 1) -> list[dict]:
    """One unmeasured warm-up run (it pays the cold kernel compilation and fills the page cache), then `pairs`
    pairs in alternating order (bare→workflow, workflow→bare, …) so neither side always runs second. `first_pair`:
    the number of the first (--first-pair), for a lease that adds pairs to an earlier lease's ledger: the numbers
    stay unique across the two and the order keeps alternating (pair N runs bare first when N is odd)."""
    if pairs < 1:
        raise ValueError(f"--train-pairs must be >= 1, got {pairs}")
    if first_pair < 1:
        raise ValueError(f"--first-pair must be >= 1, got {first_pair}")
    plan = [{"tag": "warmup", "side": warmup_side, "pair": None, "measured": False}]
    for pair in range(first_pair, first_pair + pairs):
        order = SIDES if pair % 2 else SIDES[::-1]
        plan += [{"tag": f"pair{pair}-{side}", "side": side, "pair": pair, "measured": True} for side in order]
    return plan


def steady_steps(step_ms: list[float], skip: int) -> list[float]:
    """The step times after the first `skip` logged steps (compilation, allocator and DataLoader warm-up); an
    error when fewer than 3 are left, since a rate from one or two steps says nothing."""
    kept = list(step_ms[skip:])
    if len(kept) < 3:
        raise ValueError(
            f"only {len(kept)} steady steps after skipping {skip} of {len(step_ms)}: "
            "lower --skip-steps or train more steps (--samples, --train-epochs)"
        )
    return kept


def steps_per_s(step_ms: list[float]) -> float:
    """Steps per second over a run's steady steps: count / total time (a slow step costs what it costs)."""
    return len(step_ms) / (sum(step_ms) / 1000.0)


def spread(values: list[float]) -> dict:
    """Median, min, max and interquartile range (inclusive quartiles: defined from 2 values on)."""
    ordered = sorted(values)
    out = {"n": len(ordered), "median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1]}
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        out |= {"q1": q1, "q3": q3, "iqr": q3 - q1}
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def extraction_verdict(plain: list[float], workflow: list[float], goal: float = EXTRACTION_GOAL) -> dict:
    """Warm tokens/s of each side's passes against the goal (workflow / plain). The two servers run one after the
    other (one GPU), so the passes cannot be paired: the range of the ratio is every workflow pass over every plain
    pass. 'meets the goal' when even the lowest is at or above it, 'below the goal' when even the highest is under
    it, else 'within noise'."""
    passes = min(len(plain), len(workflow))
    if passes < MIN_PAIRS:
        return {"verdict": f"no verdict: {passes} pass(es) per side, at least {MIN_PAIRS} needed for a spread"}
    low, high = round(min(workflow) / max(plain), 4), round(max(workflow) / min(plain), 4)
    verdict = "meets the goal" if low >= goal else "below the goal" if high < goal else "within noise"
    return {"ratio_range": [low, high], "goal": goal, "verdict": verdict}


def train_verdict(pair_ratios: list[float], goal: float = TRAIN_GOAL) -> str:
    """'meets the goal' when every pair is at or above it, 'below the goal' when every pair is under it, else
    'within noise': the pairs straddle 1.0 or the goal, so the spread is larger than the gap being asked about."""
    if len(pair_ratios) < MIN_PAIRS:
        return f"no verdict: {len(pair_ratios)} pair(s), at least {MIN_PAIRS} needed for a spread"
    low, high = min(pair_ratios), max(pair_ratios)
    if low < 1.0 < high or low < goal <= high:
        return "within noise"
    return "meets the goal" if low >= goal else "below the goal"


def compare_training(runs: list[dict], skip: int, goal: float = TRAIN_GOAL) -> dict:
    """From measured runs ({side, pair, step_ms}), the steady steps/s per side (median and spread), the ratio of
    medians (workflow / bare), each pair's ratio and the verdict against the goal."""
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    by_pair: dict[int, dict[str, float]] = {}
    for run in runs:
        rate = steps_per_s(steady_steps(run["step_ms"], skip))
        rates[run["side"]].append(rate)
        by_pair.setdefault(run["pair"], {})[run["side"]] = rate
    missing = [pair for pair, sides in by_pair.items() if set(sides) != set(SIDES)]
    if missing or not by_pair:
        raise ValueError(f"every pair needs one bare and one workflow run; incomplete pairs: {missing}")
    per_side = {side: spread(rates[side]) for side in SIDES}
    pair_ratios = [round(by_pair[p]["workflow"] / by_pair[p]["bare"], 4) for p in sorted(by_pair)]
    return {
        "skip_steps": skip,
        "steps_per_s": per_side,
        "ratio_of_medians": round(per_side["workflow"]["median"] / per_side["bare"]["median"], 4),
        "pair_ratios": pair_ratios,
        "goal": goal,
        "verdict": train_verdict(pair_ratios, goal),
    }


def phase_profile(runs: list[dict], skip: int) -> dict:
    """Per side, the median of each profiled phase (speculators' profile/*_ms) over the steady steps of all its
    measured runs, and workflow - bare per phase: which phase carries a gap (fetch/queue: data loading and
    workers; h2d: staging; fwd/bwd/opt: the model)."""
    pooled: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    for run in runs:
        for record in run["steps"][skip:]:
            for phase in PHASES:
                if record.get(phase) is not None:
                    pooled[run["side"]].setdefault(phase, []).append(float(record[phase]))
    medians = {side: {p: round(statistics.median(v), 3) for p, v in pooled[side].items()} for side in SIDES}
    shared = [p for p in PHASES if p in medians["bare"] and p in medians["workflow"]]
    return medians | {
        "workflow_minus_bare_ms": {p: round(medians["workflow"][p] - medians["bare"][p], 3) for p in shared}
    }


def run_ledger_key(args: argparse.Namespace, files_dir: Path) -> dict:
    """What a finished training run depends on: the same data, files and flags give the same run. A run recorded
    under another key is never reused."""
    names = ("samples", "seq_len", "seed", "train_epochs", "total_seq_len", "draft_vocab", "device")
    key = {name: getattr(args, name) for name in names} | {"target": str(args.target), "files": str(files_dir)}
    train_on = getattr(args, "train_on", None)
    return key | ({"train_on": str(train_on)} if train_on else {})


def finished_runs(ledger: Path, key: dict) -> dict[str, dict]:
    """tag -> run, for the runs an earlier call of this lease finished under the same key (the ledger is one JSON
    line per finished run). A device call is cut at 10 minutes and seven runs of the 8B shape take longer (~100 s
    each, 2026-11-29): each call goes on where the last stopped. A torn last line (a call cut while writing) is
    skipped; the run it was is redone."""
    runs: dict[str, dict] = {}
    if not ledger.is_file():
        return runs
    for line in ledger.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("key") == key:
            runs[record["run"]["tag"]] = record["run"]
    return runs


def complete_pairs(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The measured runs of pairs that have both sides, and the measured runs whose partner never ran (a lease
    that ended inside a pair): only the first go into compare_training."""
    sides: dict[int, set[str]] = {}
    for run in runs:
        if run["measured"]:
            sides.setdefault(run["pair"], set()).add(run["side"])
    whole = {pair for pair, seen in sides.items() if seen == set(SIDES)}
    measured = [run for run in runs if run["measured"]]
    return [r for r in measured if r["pair"] in whole], [r for r in measured if r["pair"] not in whole]


def training_result(runs: list[dict], skip: int) -> dict:
    """compare_training and phase_profile over the complete pairs, each run's wall and steady steps/s, and the
    runs left without a partner (named, never compared)."""
    paired, unpaired = complete_pairs(runs)
    if not paired:
        raise ValueError(f"no complete pair among the runs {[r['tag'] for r in runs]}: nothing to compare yet")
    return {
        "comparison": compare_training(paired, skip),
        "phase_medians_ms": phase_profile(paired, skip),
        "wall_s": {side: [r["wall_s"] for r in paired if r["side"] == side] for side in SIDES},
        "per_run": [
            {
                "tag": r["tag"],
                "wall_s": r["wall_s"],
                "steady_steps_per_s": round(steps_per_s(steady_steps(r["step_ms"], skip)), 4),
            }
            for r in runs
        ],
        "unpaired": [r["tag"] for r in unpaired],
    }


def record_run(ledger: Path, key: dict, run: dict) -> None:
    """Append one finished run to the ledger, flushed to disk before the next run starts."""
    with ledger.open("a") as out:
        out.write(json.dumps({"key": key, "run": run}, default=str) + "\n")
        out.flush()
        os.fsync(out.fileno())


def trainer_steps(metrics_jsonl: Path) -> list[dict]:
    """The train steps a trainer logged, in order: global_step, loss, tokens_per_s and the profile phases."""
    import pandas as pd

    from eagle3_workflow.training.metrics import metrics_table, read_metric_lines

    frame = metrics_table([read_metric_lines(metrics_jsonl)])
    train = frame[frame["split"] == "train"]
    if "step_ms" not in train:
        return []
    columns = [c for c in ("global_step", "loss", "tokens_per_s", *PHASES) if c in train]
    rows = train.dropna(subset=["step_ms"])[columns].to_dict("records")
    return [{k: (int(v) if k == "global_step" else float(v)) for k, v in r.items() if pd.notna(v)} for r in rows]


# flags whose values are paths (or the vocab-mapping files the workflow builds once and bare speculators builds
# itself from the same token_freq.pt with the same function): the only ones allowed to differ
PATH_FLAGS = {"--data-path", "--save-path", "--log-dir", "--d2t-path", "--t2d-path"}
VERSIONED = ("vllm", "speculators", "transformers", "torch")  # the *_version keys of api_compat.json


def flag_values(command: list[str]) -> dict[str, list[str]]:
    """--flag -> the values after it, for a command line of --flags (the launcher before the first one dropped)."""
    flags: dict[str, list[str]] = {}
    current = None
    for item in command:
        if item.startswith("--"):
            current = item
            flags[current] = []
        elif current is not None:
            flags[current].append(item)
    return flags


def bare_train_command(
    device: str, *, target: Path, data: Path, save: Path, log_dir: Path, target_layer_ids, common: dict, extra
) -> list[str]:
    """`speculators train` with every hyperparameter written out, through the workflow's trainer entry (it adds
    a metrics handler, and on CPU, with EAGLE3_TRAIN_DEVICE=cpu, the shim that only patches device placement).
    Nothing may be left to a speculators default the workflow sets otherwise."""
    from eagle3_workflow.trainer.command import TRAINER_ENTRY

    return [sys.executable, "-m", TRAINER_ENTRY] + [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(target),
        "--data-path", str(data),
        "--save-path", str(save),
        "--log-dir", str(log_dir),
        "--num-layers", "1",
        "--target-layer-ids", *[str(i) for i in target_layer_ids],
        "--draft-vocab-size", str(common["draft_vocab_size"]),
        "--ttt-steps", "3",
        "--lr", str(common["lr"]),
        "--optimizer", "adamw",
        "--epochs", str(common["epochs"]),
        "--total-seq-len", str(common["total_seq_len"]),
        "--train-data-ratio", str(common["train_data_ratio"]),
        "--num-workers", str(common["num_workers"]),
        "--seed", str(common["seed"]),
        "--checkpoint-freq", "1.0",
        "--on-missing", "raise",
        *extra,
    ]  # fmt: skip


def same_flags_or_exit(bare_cmd, settings, target: Path, wf_work: Path, *, target_layer_ids, device) -> None:
    """The bare command must train exactly what the workflow trains: compare it with train_draft's own command
    (built by the same function the stage uses) flag by flag; a difference (an omitted flag falls back to a
    speculators default, e.g. the Muon optimizer) stops the bench before any GPU time is spent."""
    from eagle3_workflow.trainer.command import TrainPaths, build_train_command

    paths = TrainPaths.in_work_dir(wf_work, target, settings.draft_vocab_size)
    workflow_cmd = build_train_command(
        settings, paths, device, target_layer_ids=target_layer_ids, on_missing="raise", trust_remote_code=False
    )
    bare, workflow = flag_values(bare_cmd), flag_values(workflow_cmd)
    if device.kind == "cpu":  # the shim adds these on CPU; the workflow passes them explicitly
        for flag, value in (("--draft-attn-impl", "sdpa"), ("--loss-implementation", "eager")):
            bare.setdefault(flag, [value])
    differing = {
        flag: (bare.get(flag), workflow.get(flag))
        for flag in set(bare) | set(workflow)
        if flag not in PATH_FLAGS and bare.get(flag) != workflow.get(flag)
    }
    if differing:
        raise SystemExit(f"the bare command would not train what the workflow trains: {differing} (bare, workflow)")


def training_inputs(args: argparse.Namespace, data_dir: Path, files_dir: Path, work: Path) -> dict:
    """The gate files train_draft reads (api_compat, validation) and the layer ids, written once for all runs."""
    from eagle3_workflow.files.prepared import read_input_ids
    from eagle3_workflow.provenance.collect import package_versions
    from eagle3_workflow.validation.checks import validate_files

    target = read_target_config(args.target).info()
    layer_ids = resolve_layer_ids(target.num_layers, None)
    api_compat = work / "api_compat.json"
    # a stand-in for check_api's record (the bench runs no gates): what train_draft reads from it
    installed = package_versions(VERSIONED)
    versions = {f"{name}_version": installed.get(name, "not installed") for name in VERSIONED}
    write(api_compat, ApiCompatReport(passed=True, device=args.device, layer_ids=layer_ids, checks=[], target=target,
                                      **versions))  # fmt: skip
    input_ids = read_input_ids(data_dir / "prepared")
    report = validate_files(
        input_ids, HiddenStateFiles(files_dir, len(layer_ids), target.hidden_size), max_bad_samples=0
    )
    if not report.passed:
        raise SystemExit(f"hidden-state files did not validate: {report.missing[:5]} {list(report.bad.items())[:5]}")
    validation = work / "validation.json"
    write(validation, report)
    return {"layer_ids": layer_ids, "api_compat": api_compat, "validation": validation}


def bare_data_dir(data_dir: Path, files_dir: Path, work: Path) -> Path:
    """A data dir laid out as speculators' docs say (dataset files, token_freq.pt, hidden_states/), by symlinks."""
    bare_data = work / "bare-data"
    shutil.rmtree(bare_data, ignore_errors=True)
    bare_data.mkdir(parents=True)
    for item in (data_dir / "prepared").iterdir():
        os.symlink(item.resolve(), bare_data / item.name)
    os.symlink((data_dir / "token_freq.pt").resolve(), bare_data / "token_freq.pt")
    os.symlink(files_dir.resolve(), bare_data / "hidden_states")
    return bare_data


def run_bare(ctx: dict, tag: str) -> dict:
    """One bare `speculators train` process (its own vocab mapping, its own metrics JSONL)."""
    from eagle3_workflow.trainer.entry import DEVICE_ENV, METRICS_ENV

    work = ctx["work"]
    save, metrics = work / f"bare-checkpoints-{tag}", work / f"bare-metrics-{tag}.jsonl"
    shutil.rmtree(save, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    command = bare_train_command(**ctx["bare_args"], save=save, log_dir=work / f"bare-metric-logs-{tag}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[METRICS_ENV] = str(metrics)
    if ctx["device"] == "cpu":
        env[DEVICE_ENV] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "workflow" / "scripts"), env.get("PYTHONPATH")) if p)
    log(f"training [{tag}]: bare speculators train: " + " ".join(command))
    start = time.monotonic()
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    wall_s = time.monotonic() - start
    output = proc.stdout.decode("utf-8", errors="replace")
    (work / f"bare-train-{tag}.log").write_text(output)
    shutil.rmtree(save, ignore_errors=True)  # ~3.7 GB a checkpoint for the 8B shape: the disk is 64 GiB
    if proc.returncode != 0:
        raise SystemExit(f"bare speculators train [{tag}] failed ({proc.returncode}):\n{output[-4000:]}")
    return {"command": command, "wall_s": round(wall_s, 1), "steps": trainer_steps(metrics)}


def run_workflow(ctx: dict, tag: str) -> dict:
    """One whole train_draft (fingerprint, staging, vocab mapping, trainer subprocess, checks, publishing)."""
    from eagle3_workflow.trainer.command import TrainDevice
    from eagle3_workflow.training.stage import train_draft

    work = ctx["work"]
    wf_work, out_dir = work / "workflow-train-work", work / "workflow-draft"
    shutil.rmtree(wf_work, ignore_errors=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    log(f"training [{tag}]: the workflow's train_draft")
    start = time.monotonic()
    summary = train_draft(
        ctx["settings"],
        target=ctx["target"],
        prepared=ctx["data_dir"] / "prepared",
        token_freq=ctx["data_dir"] / "token_freq.pt",
        api_compat=ctx["api_compat"],
        validation=ctx["validation"],
        files_dir=ctx["files_dir"],
        work_dir=wf_work,
        out_dir=out_dir,
        trust_remote_code=False,
        device=TrainDevice(ctx["device"], 1),
        on_line=lambda line: None,
    )
    wall_s = time.monotonic() - start
    metrics_jsonl = sorted((wf_work / "logs").glob("metrics-attempt-*.jsonl"))[-1]
    steps = trainer_steps(metrics_jsonl)
    shutil.rmtree(wf_work / "checkpoints", ignore_errors=True)
    final_loss = load(TrainingSummary, out_dir / "training.json").final_train_loss
    return {"command": summary.command, "wall_s": round(wall_s, 1), "steps": steps, "final_train_loss": final_loss}


def training_runs(ctx: dict, args: argparse.Namespace, files_dir: Path) -> list[dict]:
    """The plan's runs in order (run_plan), each run once: a run an earlier call finished under the same key is
    taken from the ledger (ctx["work"]/training-runs.jsonl), every new one is recorded there as it finishes."""
    runners = {"bare": run_bare, "workflow": run_workflow}
    ledger, key = ctx["work"] / "training-runs.jsonl", run_ledger_key(args, files_dir)
    done = finished_runs(ledger, key)
    runs = []
    for item in run_plan(args.train_pairs, first_pair=args.first_pair):
        if item["tag"] in done:
            log(f"[{item['tag']}] finished by an earlier call ({ledger}): kept, not rerun")
            runs.append(done[item["tag"]])
            continue
        run = item | runners[item["side"]](ctx, item["tag"])
        # the machine it ran on: pairs of one key from several leases are compared together (training_pairs.py)
        run |= {"host": platform.node(), "gpu": gpu_name()}
        run["step_ms"] = [s["step_ms"] for s in run["steps"]]
        log(f"[{item['tag']}] wall {run['wall_s']} s, {len(run['step_ms'])} steps logged")
        record_run(ledger, key, run)
        runs.append(run)
    return runs


def bench_training(
    args: argparse.Namespace, data_dir: Path, files_dir: Path, work: Path, rows: int, *, data_tokens: int
) -> dict:
    """A warm-up run, then --train-pairs pairs in alternating order; steady steps/s compared (compare_training)."""
    from eagle3_workflow.settings.sections import TrainSettings
    from eagle3_workflow.settings.views import with_schema_defaults
    from eagle3_workflow.trainer.command import TrainDevice

    inputs = training_inputs(args, data_dir, files_dir, work)
    ratio = 0.95
    train_rows = int(rows * ratio)
    common = {
        "draft_vocab_size": args.draft_vocab,
        "lr": 3e-4,
        "epochs": args.train_epochs,
        "total_seq_len": args.total_seq_len,
        "train_data_ratio": ratio,
        "num_workers": 4,
        "seed": 0,
    }
    extra = ["--loss-implementation", "eager"] if args.device == "cuda" else []
    layers = inputs["layer_ids"][:-1]
    bare_args = {
        "device": args.device,
        "target": args.target,
        "data": bare_data_dir(data_dir, files_dir, work),
        "target_layer_ids": layers,
        "common": common,
        "extra": extra,
    }
    train = {"gpus": 1 if args.device == "cuda" else 0, "extra_args": extra, **common}
    settings = view_of(TrainSettings, with_schema_defaults(train=train)["train"])
    probe = bare_train_command(**bare_args, save=work / "s", log_dir=work / "l")
    same_flags_or_exit(probe, settings, args.target, work / "workflow-train-work", target_layer_ids=layers,
                       device=TrainDevice(args.device, 1))  # fmt: skip
    ctx = {"work": work, "device": args.device, "target": args.target, "data_dir": data_dir, "files_dir": files_dir}
    ctx |= {"bare_args": bare_args, "settings": settings} | inputs
    runs = training_runs(ctx, args, files_dir)
    return {
        "train_rows": train_rows,
        # the synthetic rows are all --seq-len long; a run's (--train-on) differ, and which of them the trainer's
        # split keeps is speculators' choice: its data's tokens, all rows, are what is known
        **(
            {"data_tokens": data_tokens}
            if args.train_on
            else {"trained_tokens": train_rows * args.seq_len * args.train_epochs}
        ),
        "settings": common,
        "extra_args": extra,
        "bare_flags_checked": "equal to the workflow's trainer flags except " + ", ".join(sorted(PATH_FLAGS)),
        **training_result(runs, args.skip_steps),
        "runs": runs,
    }


# ---------------------------------------------------------------------------------------------------------------


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "torch", "speculators", "hs-connectors", "transformers", "safetensors", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def gpu_name() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return "none"


def run_training_data(run: Path, target: Path) -> tuple[Path, Path, int, int]:
    """--train-on: a finished pipeline run's data (data/prepared, data/token_freq.pt) and hidden-state files
    (hidden_states/files), for the training pairs without an extraction pass of the bench's own: (data dir, files
    dir, rows, tokens). The run must have been made from --target (its check_api record names the target): other
    files would not fit the trainer's target. training_inputs then validates every file against the rows."""
    from eagle3_workflow.files.prepared import read_input_ids

    data_dir, files_dir, api = run / "data", run / "hidden_states" / "files", run / "checks" / "api_compat.json"
    missing = [str(p) for p in (data_dir / "prepared", data_dir / "token_freq.pt", files_dir, api) if not p.exists()]
    if missing:
        raise SystemExit(
            f"--train-on {run}: no {', '.join(missing)}. Fix: run the pipeline through validate_hidden_states "
            "first (snakemake --until validate_hidden_states --configfile ...), or give the run's results/<run> folder"
        )
    recorded = Path(load(ApiCompatReport, api).target.path)
    recorded = recorded if recorded.is_absolute() else run.parent.parent / recorded
    if recorded.resolve() != target.resolve():
        raise SystemExit(
            f"--train-on {run} was made from the target {recorded}, not --target {target}: its hidden states are "
            "another model's. Fix: pass that run's target as --target, or a run made from this one"
        )
    input_ids = read_input_ids(data_dir / "prepared")
    return data_dir, files_dir, len(input_ids), sum(len(ids) for ids in input_ids)


def earlier_extraction_files(args: argparse.Namespace) -> Path:
    """--train-only: the hidden-state files an earlier call of the same lease extracted into --work, its last pass's
    whatever --repeats it ran with (the data is regenerated from the same seed, so the files match it;
    training_inputs validates them)."""
    passes = {
        int(n): p
        for p in args.work.glob("workflow-files-*")
        if (n := p.name.rsplit("-", 1)[1]).isdigit() and p.is_dir()
    }
    if not passes:
        raise SystemExit(
            f"--train-only needs the hidden-state files of an earlier bench call in {args.work} (no workflow-files-N "
            "folder): run the bench once without --train-only in this lease, with the same --samples/--seq-len/--seed"
        )
    return passes[max(passes)]


def extraction_lines(e: dict, args: argparse.Namespace) -> list[str]:
    lines = [
        f"EXTRACTION {e['samples']} x {args.seq_len} tokens, layers {e['layers']}, concurrency {args.concurrency}",
        f"  plain prefill      cold {e['plain_cold']['tok_per_s']:>10.1f} tok/s   warm "
        f"{max(p['tok_per_s'] for p in e['plain_warm']):>10.1f} tok/s",
        f"  connector (raw)    warm {max(p['tok_per_s'] for p in e['connector_warm']):>10.1f} tok/s",
        f"  workflow client    warm {max(p['tok_per_s'] for p in e['workflow_warm']):>10.1f} tok/s   "
        f"{e['workflow_bytes_per_s'] / 1e9:.2f} GB/s written",
        f"  RATIOS {json.dumps(e['ratios'])}",
        f"  VERDICT (workflow / plain, every pass against every pass) {json.dumps(e.get('verdict'))}",
    ]
    if "stage" in e:
        lines.insert(-1, f"  stage (cold)            {e['stage']['tok_per_s']:>10.1f} tok/s")
    if e.get("method", {}).get("warm"):
        lines.insert(2, f"  method, no files   warm {max(p['tok_per_s'] for p in e['method']['warm']):>10.1f} tok/s")
    elif "method" in e:
        lines.insert(2, f"  method, no files   no server: {e['method']['error']}")
    return lines


def training_lines(training: dict) -> list[str]:
    c = training["comparison"]
    size = (f"{training['trained_tokens']} tokens a run" if "trained_tokens" in training
            else f"{training['data_tokens']} data tokens x {training['settings']['train_data_ratio']} x "
                 f"{training['settings']['epochs']} epoch(s) a run")  # fmt: skip
    lines = [f"TRAINING {size}, steady steps/s (first {c['skip_steps']} dropped)"]
    for side in SIDES:
        s = c["steps_per_s"][side]
        lines.append(f"  {side:<9} median {s['median']:.3f}  min-max {s['min']:.3f}-{s['max']:.3f}  IQR {s.get('iqr')}")
    lines.append(
        f"  RATIO workflow/bare {c['ratio_of_medians']}  pairs {c['pair_ratios']}  goal {c['goal']}: {c['verdict']}"
    )
    lines.append(f"  PHASES workflow-bare ms {json.dumps(training['phase_medians_ms']['workflow_minus_bare_ms'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    # 3 warm passes a side: the fewest that give the ratio a spread (extraction_verdict); ~6.3 s each at the 8B shape
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="enforce_eager for every server (as the GPU run's preset)")
    parser.add_argument("--train-epochs", type=int, default=2)
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument(
        "--train-only", action="store_true", help="reuse the hidden-state files an earlier call wrote into --work"
    )
    parser.add_argument(
        "--train-on",
        type=Path,
        default=None,
        help="train on a finished pipeline run's data and hidden-state files (results/<run>, made from --target) "
        "instead of the bench's own: the training pairs only, no extraction",
    )
    parser.add_argument("--train-pairs", type=int, default=3, help="measured pairs after the warm-up run")
    parser.add_argument(
        "--first-pair",
        type=int,
        default=1,
        help="the first pair's number: a later lease's pairs join an earlier lease's ledger (training_pairs.py)",
    )
    parser.add_argument(
        "--files-only",
        action="store_true",
        help="instead of the extraction bench, the workflow's server and client once: the files the pairs train on",
    )
    parser.add_argument(
        "--skip-steps", type=int, default=SKIP_STEPS, help="logged steps dropped at the start of each run"
    )
    parser.add_argument("--stage", action="store_true", help="also time extract_replica with its own (cold) server")
    parser.add_argument(
        "--split-method",
        action="store_true",
        help="also time a server with the extract_hidden_states method but no connector (one more server start)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.target = args.target.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.train_on and args.skip_train:
        raise SystemExit("--train-on is the training pairs only; --skip-train leaves nothing to run")
    if args.files_only and (args.train_on or args.train_only):
        raise SystemExit("--files-only makes the bench's own files; --train-on and --train-only read existing ones")
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "gpu": gpu_name(),
        "versions": versions(),
        "target": str(args.target),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    if args.train_on:
        data_dir, files_dir, rows, tokens = run_training_data(args.train_on.resolve(), args.target)
        result["train_on"] = str(args.train_on.resolve())
    else:
        data_dir = args.work / "data"
        prompts = write_synthetic_prepared(args.target, data_dir, args.samples, args.seq_len, args.seed)
        rows, tokens = len(prompts), len(prompts) * args.seq_len
        if args.train_only:
            files_dir = earlier_extraction_files(args)
        else:
            part = "extraction_files" if args.files_only else "extraction"
            result[part] = (extract_files_only(args, prompts, args.work) if args.files_only
                            else bench_extraction(args, prompts, data_dir, args.work))  # fmt: skip
            files_dir = Path(result[part]["files_dir"])
            if args.out:
                write_text_atomic(args.out, json.dumps(result, indent=2, default=str) + "\n")
    if not args.skip_train:
        result["training"] = bench_training(args, data_dir, files_dir, args.work, rows, data_tokens=tokens)
    result["bench_wall_s"] = round(time.monotonic() - started, 1)
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))
    lines = extraction_lines(result["extraction"], args) if "extraction" in result else []
    if "training" in result:
        lines += training_lines(result["training"])
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
