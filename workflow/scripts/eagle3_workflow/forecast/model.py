"""The forecast itself: measured per-token costs (a CostTable) scaled to a run's target, draft and data (a RunShape),
per stage. Pure: numbers in, numbers out.

How each figure is made, and what it assumes (each assumption is one the next GPU measurement checks):
- extract_hidden_states: the measured prefill rate of the reference target (tokens/s on one GPU, the workflow's own
  extraction server) scaled by parameters per token (compute-bound prefill: the GPU time of a token grows with the
  weights it multiplies). A replica of g GPUs runs g GPUs' worth of tokens (tensor parallelism assumed to scale
  linearly), each replica pays the measured server start once: the start measured with CUDA graphs on a fresh
  node (empty compile caches) unless the run serves eager (vllm.enforce_eager). Disk: every token's captured states (ids x hidden x 2
  bytes), exact.
- train_draft: the measured steady rate of the reference draft (tokens/s on one GPU, steps after the first) scaled
  by the draft's parameters per token, times epochs over the training rows' tokens; the GPUs share the tokens
  (data-parallel, linear); one measured fixed cost per run (staging, trainer start, the first step's compilation on
  a fresh node, validation passes and saves: the measured run's wall minus its steady steps). Disk: the trainer's
  checkpoints (trainer.checkpoint_size: the draft in bf16 with its optimizer state, every saved epoch kept) and the
  published draft's weights, which the trainer's own check refuses to start without (to 0.1% of what the 8B shape's
  and the real-width Kimi stand-in's runs wrote, 2026-12-06).
Each forecast keeps its two parts (`start_s`, paid once; `per_token_s`, the rest) so that a measured run says which
part missed (bench/gpu/forecast_check.py).
- The other stages have no cost measured at a shape that scales: they are listed, not forecast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class MeasuredRate:
    """One rate measured on one GPU: `tokens_per_s` for a model of `params_per_token`, `start_s` paid once per
    process (server start, or a training run's fixed cost); `eager_start_s`, where measured, the server's start with
    enforce_eager (no compilation, no graph capture). `starts_seen`: every fresh node's start measured, where more
    than one; `start_s` is then their mean (a start is mostly the host's CPU: imports, torch.compile; two H100 hosts
    of one kind started the 8B shape's extraction server in 107.75 and 74.82 s)."""

    tokens_per_s: float
    params_per_token: int
    start_s: float
    source: str  # what, where, when: the cost table's entry, for the printout
    eager_start_s: float | None = None
    start_date: str | None = None  # when the start-up costs were measured, where not with the rate
    starts_seen: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class CostTable:
    machine: str
    extraction: MeasuredRate
    training: MeasuredRate


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What the forecast needs of a run: the data's tokens, the target's and draft's parameters per token, the
    captured states, and the parallelism the config asks for."""

    samples: int
    tokens: int
    tokens_source: str  # where the token count came from (the prepared data's manifest, or the flags)
    target_params_per_token: int
    draft_params_per_token: int
    hidden_size: int
    captured_ids: int
    replicas: int
    gpus_per_replica: int
    train_gpus: int
    epochs: int
    train_data_ratio: float
    eager: bool = False  # vllm.enforce_eager: the extraction server starts without compilation or CUDA graphs
    checkpoint_bytes: int | None = None  # one saved epoch of the trainer (trainer.checkpoint_size), None: unknown
    saved_checkpoints: int = 0  # how many epochs save one (speculators keeps every one)
    published_bytes: int = 0  # the published draft's weights (draft/model.safetensors, trainer.checkpoint_size)


@dataclasses.dataclass(frozen=True)
class StageForecast:
    stage: str
    gpu_hours: float | None
    wall_s: float | None
    disk_bytes: int | None
    basis: str  # how the figures were made, or why there are none
    start_s: float | None = None  # the wall's part paid once
    start_range: tuple[float, float] | None = None  # the fresh nodes' starts measured, lowest and highest
    per_token_s: float | None = None  # the wall's part that grows with the tokens


NOT_FORECAST = ("check_api", "canary", "validate_hidden_states", "evaluate_draft")


def start_when(rate: MeasuredRate, params_per_token: int) -> str:
    """When the start-up cost was measured, and, for another model than the one it was measured on, that it is that
    model's: a start (loading, compilation, the first step) is not scaled (the real-width Kimi stand-in's extraction
    server started in 2.4x the 8B shape's, its training in 0.68x: bench/gpu/results/2026-12-06-kimi-k25-real-width/)."""
    when = f" {rate.start_date}" if rate.start_date else ""
    what = "start measured"
    if seen := start_range(rate):
        what = f"start: the mean of {len(rate.starts_seen)} fresh nodes' {seen[0]:.0f}-{seen[1]:.0f} s, measured"
    if params_per_token == rate.params_per_token:
        return f" ({what}{when})" if when or rate.starts_seen else ""
    return f" ({what}{when} on the {rate.params_per_token / 1e9:.2f}B reference, not scaled to this model)"


def start_range(rate: MeasuredRate) -> tuple[float, float] | None:
    return (min(rate.starts_seen), max(rate.starts_seen)) if len(rate.starts_seen) > 1 else None


def extraction_forecast(run: RunShape, costs: CostTable) -> StageForecast:
    rate = costs.extraction
    gpu_s = run.tokens * run.target_params_per_token / (rate.tokens_per_s * rate.params_per_token)
    gpus = run.replicas * run.gpus_per_replica
    start = rate.eager_start_s if run.eager and rate.eager_start_s is not None else rate.start_s
    wall = start + gpu_s / gpus
    return StageForecast(
        stage="extract_hidden_states",
        gpu_hours=gpus * wall / 3600,
        wall_s=wall,
        disk_bytes=run.tokens * run.captured_ids * run.hidden_size * 2,
        basis=(
            f"{run.tokens:,} tokens x {run.target_params_per_token / 1e9:.2f}B params/token at "
            f"{rate.tokens_per_s:,.0f} tok/s per GPU for {rate.params_per_token / 1e9:.2f}B ({rate.source}); "
            f"{run.replicas} replica(s) x {run.gpus_per_replica} GPU(s), each starting in {start:.0f} s"
            f"{' (vllm.enforce_eager)' if start != rate.start_s else ''}{start_when(rate, run.target_params_per_token)}"
        ),
        start_s=start,
        per_token_s=gpu_s / gpus,
        start_range=start_range(rate) if start == rate.start_s else None,
    )


def training_forecast(run: RunShape, costs: CostTable) -> StageForecast:
    rate = costs.training
    trained = run.tokens * run.train_data_ratio * run.epochs
    gpu_s = trained * run.draft_params_per_token / (rate.tokens_per_s * rate.params_per_token)
    wall = rate.start_s + gpu_s / run.train_gpus
    known = run.checkpoint_bytes is not None
    disk = run.checkpoint_bytes * run.saved_checkpoints + run.published_bytes if known else None
    checkpoints = (
        f"; disk: {run.saved_checkpoints} checkpoint(s) of {run.checkpoint_bytes / 1e9:.2f} GB, all kept, and the "
        f"published draft's {run.published_bytes / 1e9:.2f} GB"
        if known
        else ""
    )
    return StageForecast(
        stage="train_draft",
        gpu_hours=run.train_gpus * wall / 3600,
        wall_s=wall,
        disk_bytes=disk,
        basis=(
            f"{run.epochs} epoch(s) x {run.tokens * run.train_data_ratio:,.0f} training tokens x "
            f"{run.draft_params_per_token / 1e9:.3f}B draft params/token at {rate.tokens_per_s:,.0f} tok/s per GPU "
            f"for {rate.params_per_token / 1e9:.3f}B ({rate.source}); {run.train_gpus} GPU(s), "
            f"{rate.start_s:.0f} s fixed per run{start_when(rate, run.draft_params_per_token)}{checkpoints}"
        ),
        start_s=rate.start_s,
        per_token_s=gpu_s / run.train_gpus,
        start_range=start_range(rate),
    )


def forecast(run: RunShape, costs: CostTable) -> list[StageForecast]:
    """Per stage, in the pipeline's order; the stages without a measured cost say so."""
    rows = [extraction_forecast(run, costs), training_forecast(run, costs)]
    rows += [StageForecast(s, None, None, None, "no cost measured at a shape that scales") for s in NOT_FORECAST]
    order = ["check_api", "canary", "extract_hidden_states", "validate_hidden_states", "train_draft", "evaluate_draft"]
    return sorted(rows, key=lambda r: order.index(r.stage))


def as_json(rows: list[StageForecast], run: RunShape, costs: CostTable) -> dict[str, Any]:
    """forecast.json's shape (issue #42): {"stages": [{"stage", "quantity", "forecast", "unit"}, ...]}, plus the run
    shape and the costs' machine; a measured run adds "measured" beside each forecast."""
    stages = []
    for row in rows:
        for quantity, value, unit in (
            ("gpu_hours", row.gpu_hours, "GPU-h"),
            ("wall", row.wall_s, "s"),
            ("disk", row.disk_bytes, "bytes"),
            ("start", row.start_s, "s"),
            ("per_token", row.per_token_s, "s"),
        ):
            if value is not None:
                stages.append({"stage": row.stage, "quantity": quantity, "forecast": round(value, 4), "unit": unit})
                if quantity == "start" and row.start_range:
                    stages[-1]["range"] = [round(v, 4) for v in row.start_range]
    return {"machine": costs.machine, "run": dataclasses.asdict(run), "stages": stages}


def cost_table(raw: Mapping[str, Any], params_per_token: Callable[[str, int | None], int]) -> CostTable:
    """A CostTable from config/costs/<machine>.yaml. `params_per_token(shape file, draft vocabulary or None)` counts
    the reference shape's target (None) or draft parameters per token (the caller reads the shape's config.json)."""

    def rate(section: str, draft: bool) -> MeasuredRate:
        entry = raw[section]
        seen = tuple(float(s) for s in entry.get("starts_seen") or ())
        if seen and "start_s" in entry:
            raise ValueError(
                f"config/costs: {section} gives both start_s and starts_seen; keep starts_seen (start_s is their mean)"
            )
        return MeasuredRate(
            tokens_per_s=float(entry["tokens_per_s"]),
            params_per_token=params_per_token(entry["shape"], int(entry["draft_vocab_size"]) if draft else None),
            start_s=sum(seen) / len(seen) if seen else float(entry["start_s"]),
            starts_seen=seen,
            source=f"{entry['date']}, {entry['source']}",
            eager_start_s=float(entry["eager_start_s"]) if entry.get("eager_start_s") is not None else None,
            start_date=str(entry["start_date"]) if entry.get("start_date") else None,
        )

    return CostTable(machine=str(raw["machine"]), extraction=rate("extraction", False), training=rate("training", True))
