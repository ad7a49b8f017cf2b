"""Side by side on one GPU: the workflow's extraction against plain vLLM prefill, and the workflow's train_draft
against bare `speculators train`, on the same data.

usage: python bench/gpu/bench_gpu.py --target DIR --work DIR [--samples 128] [--seq-len 2048] [--concurrency 64]
                                     [--eager] [--train-epochs 2] [--skip-train] [--out FILE.json]

Data: --samples synthetic prompts of --seq-len random token ids of the target's tokenizer (all positions trained),
written in prepare_data's layout (a HF dataset saved to disk + token_freq.pt), so every stage function reads it as
it reads a real run's.

Extraction (tokens/s = prompt tokens / seconds; a server's start-up is never inside a clock):
  plain         a vLLM server without the hidden-states method, the same engine settings as the workflow's server
                (eagle3_workflow.vllm_server.hidden_states_server_spec minus speculative/kv-transfer config),
                1-token completions from an async HTTP client at --concurrency; pass 1 cold (right after ready,
                as the stage starts), then warm passes
  connector     the workflow's extraction server (extract_hidden_states + ExampleHiddenStatesConnector), the same
                raw client; the clock stops when the last file's writer lock is released (file complete on disk):
                what vLLM + its connector cost, without the workflow's client
  workflow      the same server (warm), eagle3_workflow.extraction.extract_samples: the stage's client (waits for
                each file's lock, checks its header and token ids, renames it atomically)
  stage         eagle3_workflow.extraction.extract_replica: the whole stage function as the rule runs it (disk
                preflight, resume scan, own server, client, manifest); its manifest's tokens_per_s (cold)
                (only with --stage: one more server start)
Ratios: workflow / plain(warm), connector / plain(warm), workflow / connector (the client's own cost),
stage / plain(cold). Bytes/s = hidden-state bytes written / time.

Training (same prepared data, same hidden-state files, same flags; flex attention, eager loss):
  bare          speculators' `speculators train` (cli.main(TrainConfig.resolve(argv))) through the workflow's trainer
                entry, which only adds a JSONL handler on its metric logger (and on CPU the shim's device patches);
                flags written out below
  workflow      eagle3_workflow.training.train_draft (fingerprint, staging, vocab mapping, trainer subprocess with
                its output streamed line by line, checkpoint checks, publishing draft/)
tokens/s = trained tokens (rows of the train split x epochs) / seconds: end to end (process or stage wall) and the
trainer's own step rate (sum of tokens / sum of step time over the steps it profiled, from its metric records).
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow" / "scripts"))

from eagle3_workflow.contracts import write_json_atomic  # noqa: E402
from eagle3_workflow.extraction import (  # noqa: E402
    ClientSettings,
    ProgressTracker,
    Sample,
    extract_replica,
    extract_samples,
)
from eagle3_workflow.hidden_states import resolve_layer_ids  # noqa: E402
from eagle3_workflow.vllm_server import VLLMServer, hidden_states_server_spec  # noqa: E402


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# data


def write_synthetic_prepared(target: Path, out: Path, samples: int, seq_len: int, seed: int) -> list[list[int]]:
    """prepare_data's layout (eagle3_workflow.prepare.write_prepared) with random ids of the target's tokenizer."""
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


def bench_extraction(args: argparse.Namespace, prompts: list[list[int]], data_dir: Path, work: Path) -> dict:
    config = json.loads((args.target / "config.json").read_text())
    layers = resolve_layer_ids(int(config["num_hidden_layers"]), None)
    hidden = int(config["hidden_size"])
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

    def spec(storage: str):
        return hidden_states_server_spec(
            vllm_settings,
            model=str(args.target),
            layer_ids=layers,
            storage_dir=storage,
            device=args.device,
            tensor_parallel_size=1,
            trust_remote_code=False,
            dtype="bfloat16",
            enable_render_endpoint=False,
        )

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
            files = work / f"workflow-files-{repeat}"
            shutil.rmtree(files, ignore_errors=True)
            settings = ClientSettings(concurrency=args.concurrency, progress_interval_s=10)
            start = time.monotonic()
            written = extract_samples(
                server,
                samples,
                files,
                layer_count=len(layers),
                hidden_size=hidden,
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
    bytes_per_run = workflow[-1]["bytes"]
    result["bytes_per_run"] = bytes_per_run
    result["workflow_bytes_per_s"] = round(bytes_per_run * best["workflow_warm"] / tokens, 1)
    result["connector_bytes_per_s"] = round(connector[-1]["bytes"] * best["connector_warm"] / tokens, 1)
    result["files_dir"] = str(work / f"workflow-files-{args.repeats - 1}")
    if not args.stage:
        return result
    log("stage: extract_replica (own server, cold, as the rule runs it)")
    stage_files = work / "stage-files"
    shutil.rmtree(stage_files, ignore_errors=True)
    manifest = extract_replica(
        prepared_dir=data_dir / "prepared",
        replica=0,
        replicas=1,
        files_dir=stage_files,
        scratch_dir=work / "stage-scratch",
        progress_path=work / "stage-progress.json",
        server_spec_factory=spec,
        server_log=work / "stage-server.log",
        layer_count=len(layers),
        hidden_size=hidden,
        settings=ClientSettings(concurrency=args.concurrency, progress_interval_s=10),
        disk_margin=1.1,
        available_bytes_override=None,
    )
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


def trainer_step_rate(metrics_jsonl: Path) -> dict:
    """Sum of tokens / sum of step time over the steps the trainer profiled (its metric records)."""
    from eagle3_workflow.training.metrics import metrics_table, read_metric_lines

    frame = metrics_table([read_metric_lines(metrics_jsonl)])
    train = frame[frame["split"] == "train"]
    if "step_ms" not in train or train["step_ms"].dropna().empty:
        return {"steps_profiled": 0}
    steps = train.dropna(subset=["step_ms", "tokens_per_s"])
    tokens = (steps["tokens_per_s"] * steps["step_ms"] / 1000.0).sum()
    seconds = steps["step_ms"].sum() / 1000.0
    # the first step of a run pays kernel compilation: the rate without it is the steady one
    rest = steps.iloc[1:]
    steady = (
        (rest["tokens_per_s"] * rest["step_ms"] / 1000.0).sum() / (rest["step_ms"].sum() / 1000.0) if len(rest) else 0
    )
    return {
        "steps_profiled": int(len(steps)),
        "tok_per_s_all_steps": round(float(tokens / seconds), 1),
        "tok_per_s_after_first_step": round(float(steady), 1),
        "median_step_ms": round(float(statistics.median(steps["step_ms"])), 1),
        "final_loss": float(train["loss"].dropna().iloc[-1]) if "loss" in train else None,
    }


# flags whose values are paths (or the vocab-mapping files the workflow builds once and bare speculators builds
# itself from the same token_freq.pt with the same function): the only ones allowed to differ
PATH_FLAGS = {"--data-path", "--save-path", "--log-dir", "--d2t-path", "--t2d-path"}


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
    from eagle3_workflow.training.command import TRAINER_ENTRY

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


def same_flags_or_exit(bare_cmd, settings, target: Path, wf_work: Path, target_layer_ids, device) -> None:
    """The bare command must train exactly what the workflow trains: compare it with train_draft's own command
    (built by the same function the stage uses) flag by flag; a difference (an omitted flag falls back to a
    speculators default, e.g. the Muon optimizer) stops the bench before any GPU time is spent."""
    from eagle3_workflow.training.command import TrainPaths, build_train_command

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


def bench_training(args: argparse.Namespace, data_dir: Path, files_dir: Path, work: Path, rows: int) -> dict:
    from eagle3_workflow.contracts import read_json
    from eagle3_workflow.extraction import load_prepared_input_ids
    from eagle3_workflow.trainer_entry import DEVICE_ENV, METRICS_ENV
    from eagle3_workflow.training.command import TrainDevice, TrainSettings
    from eagle3_workflow.training.stage import train_draft
    from eagle3_workflow.validation import validate_files

    config = json.loads((args.target / "config.json").read_text())
    layer_ids = resolve_layer_ids(int(config["num_hidden_layers"]), None)
    prepared = data_dir / "prepared"
    api_compat = work / "api_compat.json"
    write_json_atomic(api_compat, {"passed": True, "layer_ids": layer_ids, "device": args.device})
    input_ids = load_prepared_input_ids(prepared)
    report = validate_files(input_ids, files_dir, layer_count=len(layer_ids), hidden_size=int(config["hidden_size"]))
    if not report.passed:
        raise SystemExit(f"hidden-state files did not validate: {report.missing[:5]} {list(report.bad.items())[:5]}")
    validation = work / "validation.json"
    write_json_atomic(validation, report)
    ratio = 0.95
    train_rows = int(rows * ratio)
    tokens = train_rows * args.seq_len * args.train_epochs
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
    result: dict = {"train_rows": train_rows, "trained_tokens": tokens, "settings": common, "extra_args": extra}

    # bare: speculators' own CLI on a data dir laid out as its docs say (dataset files, token_freq.pt,
    # hidden_states/), building its own vocab mapping
    bare_data = work / "bare-data"
    shutil.rmtree(bare_data, ignore_errors=True)
    bare_data.mkdir(parents=True)
    for item in prepared.iterdir():
        os.symlink(item.resolve(), bare_data / item.name)
    os.symlink((data_dir / "token_freq.pt").resolve(), bare_data / "token_freq.pt")
    os.symlink(files_dir.resolve(), bare_data / "hidden_states")
    bare_save = work / "bare-checkpoints"
    shutil.rmtree(bare_save, ignore_errors=True)
    bare_cmd = bare_train_command(
        args.device,
        target=args.target,
        data=bare_data,
        save=bare_save,
        log_dir=work / "bare-metric-logs",
        target_layer_ids=layer_ids[:-1],
        common=common,
        extra=extra,
    )
    settings = TrainSettings(gpus=1 if args.device == "cuda" else 0, extra_args=tuple(extra), **common)
    wf_work = work / "workflow-train-work"
    same_flags_or_exit(bare_cmd, settings, args.target, wf_work, layer_ids[:-1], TrainDevice(args.device, 1))
    result["bare_flags_checked"] = "equal to the workflow's trainer flags except " + ", ".join(sorted(PATH_FLAGS))
    bare_metrics = work / "bare-metrics.jsonl"
    bare_metrics.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[METRICS_ENV] = str(bare_metrics)
    if args.device == "cpu":
        env[DEVICE_ENV] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "workflow" / "scripts"), env.get("PYTHONPATH")) if p)
    log("training: bare speculators train: " + " ".join(bare_cmd))
    start = time.monotonic()
    proc = subprocess.run(bare_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    bare_s = time.monotonic() - start
    bare_log = proc.stdout.decode("utf-8", errors="replace")
    (work / "bare-train.log").write_text(bare_log)
    if proc.returncode != 0:
        raise SystemExit(f"bare speculators train failed ({proc.returncode}):\n{bare_log[-4000:]}")
    result["bare"] = {
        "command": bare_cmd,
        "wall_s": round(bare_s, 1),
        "tok_per_s_end_to_end": round(tokens / bare_s, 1),
    }
    result["bare"] |= trainer_step_rate(bare_metrics)
    shutil.rmtree(bare_save, ignore_errors=True)  # ~3.7 GB a checkpoint for this shape: the disk is 64 GiB
    log(f"bare: {result['bare']}")

    log("training: the workflow's train_draft")
    shutil.rmtree(wf_work, ignore_errors=True)
    start = time.monotonic()
    summary = train_draft(
        settings,
        target=args.target,
        prepared=prepared,
        token_freq=data_dir / "token_freq.pt",
        api_compat=api_compat,
        validation=validation,
        files_dir=files_dir,
        work_dir=wf_work,
        out_dir=work / "workflow-draft",
        device=TrainDevice(args.device, 1),
        on_line=lambda line: None,
    )
    wf_s = time.monotonic() - start
    metrics_jsonl = sorted((wf_work / "logs").glob("metrics-attempt-*.jsonl"))[-1]
    result["workflow"] = {
        "command": summary.command,
        "wall_s": round(wf_s, 1),
        "tok_per_s_end_to_end": round(tokens / wf_s, 1),
        "steps": summary.steps,
    } | trainer_step_rate(metrics_jsonl)
    log(f"workflow: {result['workflow']}")
    shutil.rmtree(wf_work / "checkpoints", ignore_errors=True)
    metrics = read_json(work / "workflow-draft" / "training.json")
    result["workflow"]["final_train_loss"] = metrics.get("final_train_loss")
    b, w = result["bare"], result["workflow"]
    result["ratios"] = {
        "end_to_end": round(w["tok_per_s_end_to_end"] / b["tok_per_s_end_to_end"], 3),
        "trainer_steps": (
            round(w["tok_per_s_all_steps"] / b["tok_per_s_all_steps"], 3)
            if w.get("tok_per_s_all_steps") and b.get("tok_per_s_all_steps")
            else None
        ),
    }
    return result


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="enforce_eager for every server (as the GPU run's preset)")
    parser.add_argument("--train-epochs", type=int, default=2)
    parser.add_argument("--total-seq-len", type=int, default=8192)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--stage", action="store_true", help="also time extract_replica with its own (cold) server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.target = args.target.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    data_dir = args.work / "data"
    prompts = write_synthetic_prepared(args.target, data_dir, args.samples, args.seq_len, args.seed)
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "gpu": gpu_name(),
        "versions": versions(),
        "target": str(args.target),
        "command": " ".join([sys.executable, *sys.argv]),
    }
    result["extraction"] = bench_extraction(args, prompts, data_dir, args.work)
    if args.out:
        write_json_atomic(args.out, result)
    if not args.skip_train:
        files_dir = Path(result["extraction"]["files_dir"])
        result["training"] = bench_training(args, data_dir, files_dir, args.work, len(prompts))
    result["bench_wall_s"] = round(time.monotonic() - started, 1)
    if args.out:
        write_json_atomic(args.out, result)
    print(json.dumps(result, indent=2, default=str))
    e = result["extraction"]
    lines = [
        f"EXTRACTION {e['samples']} x {args.seq_len} tokens, layers {e['layers']}, concurrency {args.concurrency}",
        f"  plain prefill      cold {e['plain_cold']['tok_per_s']:>10.1f} tok/s   warm "
        f"{max(p['tok_per_s'] for p in e['plain_warm']):>10.1f} tok/s",
        f"  connector (raw)    warm {max(p['tok_per_s'] for p in e['connector_warm']):>10.1f} tok/s",
        f"  workflow client    warm {max(p['tok_per_s'] for p in e['workflow_warm']):>10.1f} tok/s   "
        f"{e['workflow_bytes_per_s'] / 1e9:.2f} GB/s written",
        f"  RATIOS {json.dumps(e['ratios'])}",
    ]
    if "stage" in e:
        lines.insert(-1, f"  stage (cold)            {e['stage']['tok_per_s']:>10.1f} tok/s")
    if "training" in result:
        t = result["training"]
        lines += [
            f"TRAINING {t['trained_tokens']} tokens",
            f"  bare      wall {t['bare']['wall_s']} s  e2e {t['bare']['tok_per_s_end_to_end']} tok/s  steps "
            f"{t['bare'].get('tok_per_s_all_steps')} tok/s",
            f"  workflow  wall {t['workflow']['wall_s']} s  e2e {t['workflow']['tok_per_s_end_to_end']} tok/s  steps "
            f"{t['workflow'].get('tok_per_s_all_steps')} tok/s",
            f"  RATIOS {json.dumps(t['ratios'])}",
        ]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
