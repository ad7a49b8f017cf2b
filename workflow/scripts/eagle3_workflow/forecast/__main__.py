"""The forecast of a run before it starts: per stage, GPU-hours, wall time and disk (issue #42).

    python -m eagle3_workflow.forecast --configfile PRESET [OVERLAY ...] [--samples N --mean-tokens T]
        [--target-config config.json] [--costs config/costs/h200.yaml] [--json forecast.json]
    make plan PRESET=config/presets/llama-3.1-8b.yaml PLAN_ARGS="--samples 500000 --mean-tokens 1024"

The data's size comes from prepare_data's manifest (results/<run>/data/manifest.json) once it exists; before that,
from --samples and --mean-tokens (a plan is made before any data is prepared: say what you expect). The target's
shape comes from its config.json (target.path), or --target-config for a target not on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from eagle3_workflow.forecast.model import RunShape, as_json, cost_table, forecast
from eagle3_workflow.forecast.shape import active_params_per_token, draft_params_per_token
from eagle3_workflow.reference.target_config import text_section
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import trains_online
from eagle3_workflow.trainer.checkpoint_size import checkpoint_bytes, draft_model_bytes, draft_tensors, saved_epochs

REPO_ROOT = Path(__file__).resolve().parents[4]  # the cost tables name their reference shapes from here
DEFAULT_COSTS = REPO_ROOT / "config" / "costs" / "h200.yaml"
DEFAULT_CAPTURED_IDS = 4  # EAGLE-3's [2, N//2, N-3, N] when hidden_states.layer_ids is not set


def merged_config(files: list[Path]) -> dict[str, Any]:
    """The config files merged as `snakemake --configfile A B` merges them (Snakemake's own update_config: later
    keys win, recursively), with the schema's defaults filled in (the workflow's own validation)."""
    from snakemake.utils import update_config

    from eagle3_workflow.settings.schema import validate_config
    from eagle3_workflow.settings.views import SCHEMA_PATH

    config: dict[str, Any] = {}
    for path in files:
        update_config(config, yaml.safe_load(path.read_text()) or {})
    validate_config(config, SCHEMA_PATH)
    return config


def target_text(config: dict[str, Any], override: Path | None) -> dict[str, Any]:
    path = override or Path(str(config["target"].get("path") or "")) / "config.json"
    if not path.is_file():
        raise StageError(
            f"the forecast needs the target's config.json and found none at {str(path)!r}: the target is not on this "
            "machine (or is built by the workflow). Fix: pass --target-config <its config.json> (e.g. "
            "bench/gpu/llama8b-shape-config.json for the Llama-3.1-8B shape)"
        )
    return text_section(json.loads(path.read_text()))


def data_size(config: dict[str, Any], samples: int | None, mean_tokens: float | None) -> tuple[int, int, str]:
    """(samples, tokens, where they came from)."""
    manifest = Path("results") / str(config["run"]) / "data" / "manifest.json"
    if samples is None and mean_tokens is None and manifest.is_file():
        found = json.loads(manifest.read_text())
        return int(found["records_kept"]), int(found["total_tokens"]), f"prepare_data's {manifest}"
    samples = samples if samples is not None else config["data"].get("max_samples")
    if samples is None or mean_tokens is None:
        raise StageError(
            f"the forecast needs the data's size: {manifest} does not exist yet (prepare_data writes it), and "
            f"{'--mean-tokens' if samples is not None else '--samples (or data.max_samples) and --mean-tokens'} "
            "is not given. Fix: pass --samples N --mean-tokens T (tokens per conversation, prompt and answer)"
        )
    return int(samples), round(samples * mean_tokens), f"--samples {samples} x --mean-tokens {mean_tokens}"


def run_shape(config: dict[str, Any], text: dict[str, Any], samples: int, tokens: int, source: str) -> RunShape:
    train, extraction = config["train"], config["extraction"]
    if not train["gpus"] or not extraction["gpus_per_replica"]:
        raise StageError(
            f"train.gpus is {train['gpus']} and extraction.gpus_per_replica {extraction['gpus_per_replica']}: the "
            "forecast is for GPU runs, and its costs were measured on GPUs. Fix: plan a GPU preset (e.g. "
            "config/presets/llama-3.1-8b.yaml)"
        )
    if trains_online(config):
        raise StageError(
            "train.hidden_states is online: the target serves the trainer during training, and no cost of that "
            "has been measured at a shape that scales (bench/gpu/online_vs_offline_gpu.py measures it). Fix: plan "
            "the offline run (train.hidden_states: offline) for now"
        )
    ids = config["hidden_states"].get("layer_ids")
    captured = len(ids) if ids else DEFAULT_CAPTURED_IDS
    draft = draft_tensors(
        text,
        draft_layers=int(train["draft_layers"]),
        draft_vocab_size=int(train["draft_vocab_size"]),
        captured_layers=captured - 1,  # the last id is the verifier's, not an input of the draft's fc
    )
    return RunShape(
        samples=samples,
        tokens=tokens,
        tokens_source=source,
        target_params_per_token=active_params_per_token(text),
        draft_params_per_token=draft_params_per_token(text, int(train["draft_vocab_size"])),
        hidden_size=int(text["hidden_size"]),
        captured_ids=captured,
        replicas=int(extraction["replicas"]),
        gpus_per_replica=int(extraction["gpus_per_replica"]),
        train_gpus=int(train["gpus"]),
        epochs=int(train["epochs"]),
        train_data_ratio=float(train["train_data_ratio"]),
        eager=bool(config["vllm"]["enforce_eager"]),
        checkpoint_bytes=checkpoint_bytes(draft, str(train["optimizer"])),
        saved_checkpoints=len(saved_epochs(int(train["epochs"]), float(train["checkpoint_freq"]))),
        published_bytes=draft_model_bytes(draft),
    )


def reference_params(shape_file: str, draft_vocab_size: int | None) -> int:
    text = text_section(json.loads((REPO_ROOT / shape_file).read_text()))
    return active_params_per_token(text) if draft_vocab_size is None else draft_params_per_token(text, draft_vocab_size)


def human(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def disk_size(n_bytes: float) -> str:
    """Decimal units, as disks are sold; terabytes from 1,000 GB on (a 500k-sample run's hidden states)."""
    return f"{n_bytes / 1e12:,.1f} TB" if n_bytes >= 1e12 else f"{n_bytes / 1e9:.1f} GB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_workflow.forecast", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configfile", type=Path, nargs="+", required=True)
    parser.add_argument("--samples", type=int)
    parser.add_argument("--mean-tokens", type=float)
    parser.add_argument("--target-config", type=Path)
    parser.add_argument("--costs", type=Path, default=DEFAULT_COSTS)
    parser.add_argument("--json", type=Path, help="write forecast.json here")
    args = parser.parse_args(argv)
    try:
        config = merged_config(args.configfile)
        samples, tokens, source = data_size(config, args.samples, args.mean_tokens)
        run = run_shape(config, target_text(config, args.target_config), samples, tokens, source)
        costs = cost_table(yaml.safe_load(args.costs.read_text()), reference_params)
    except StageError as exc:
        print(f"forecast: {exc}", file=sys.stderr)
        return 2
    rows = forecast(run, costs)
    print(f"forecast for run {config['run']!r}: {samples:,} samples, {tokens:,} tokens ({source})")
    print(f"costs: {args.costs} ({costs.machine})")
    print(f"{'stage':24s} {'GPU-hours':>10s} {'wall':>10s} {'disk':>10s}  basis")
    for row in rows:
        gpu_h = f"{row.gpu_hours:.2f}" if row.gpu_hours is not None else "-"
        wall = human(row.wall_s) if row.wall_s is not None else "-"
        disk = disk_size(row.disk_bytes) if row.disk_bytes is not None else "-"
        print(f"{row.stage:24s} {gpu_h:>10s} {wall:>10s} {disk:>10s}  {row.basis}")
    if args.json:
        args.json.write_text(json.dumps(as_json(rows, run, costs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
