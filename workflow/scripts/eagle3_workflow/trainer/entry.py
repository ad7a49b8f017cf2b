"""The entry of every trainer process the workflow starts (speculators 0.9.0).

Usage: ``python -m eagle3_workflow.trainer.entry <speculators train args>``, or under torchrun
``torch.distributed.run ... -m eagle3_workflow.trainer.entry <args>``. The arguments are ``speculators train``'s,
unchanged; the entry runs speculators' own ``cli.main(TrainConfig.resolve(argv))`` (what ``python -m
speculators.train`` runs) with these additions, the last two chosen by the environment, so that the trainer's
flags stay exactly speculators' (bench/gpu/bench_gpu.py compares them flag by flag):

- always, ``trainer.interrupt``'s patches: a stop signal saves ``checkpoints/interrupted`` with the epoch and step
  it holds (speculators records none there), at a step boundary, so that the rerun can resume from it;
- ``EAGLE3_TRAIN_METRICS_JSONL=<path>``: rank 0 appends each record of speculators' ``speculators.metrics``
  logger that carries a step (``extra={"step": ...}``: train steps and validation epochs) to ``<path>`` as one
  JSON line ``{"step": <step>, "metrics": <the record's dict>}``. The metrics are read from the trainer's own
  dicts, not from its console text;
- ``EAGLE3_TRAIN_DEVICE=cpu``: the CPU shim's patches and defaults (``trainer.cpu_shim``), for a machine with no
  accelerator. On CUDA the entry adds only the metrics handler and the interrupt patches;
- ``EAGLE3_ONLINE_SPEC=<json>`` (train.hidden_states: online): ``trainer.online_samples``' dataset, which checks each sample
  generated on demand and applies train.online.max_failed_samples.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle3_workflow.trainer.online_spec import ONLINE_SPEC_ENV

METRICS_ENV = "EAGLE3_TRAIN_METRICS_JSONL"
DEVICE_ENV = "EAGLE3_TRAIN_DEVICE"
METRICS_LOGGER = "speculators.metrics"
# the line a CPU trainer prints when it has frozen its imported heap (freeze_imported_heap)
FROZEN_LINE = "trainer entry (CPU): the imported heap frozen out of garbage collections"


def _jsonable(value: Any) -> Any:
    try:
        return float(value)  # a 0-d tensor or numpy scalar a future speculators might log without .item()
    except (TypeError, ValueError):
        return str(value)


def metric_line(message: Any, step: Any) -> str | None:
    """One JSON line for a metric record, or None for what is not one (text, hyperparameters: no step)."""
    if not isinstance(message, Mapping) or step is None:
        return None
    return json.dumps({"step": int(step), "metrics": message}, default=_jsonable)


class JsonlMetricHandler(logging.Handler):
    """Appends each metric record to a file, one JSON line each, closed after every line (a kill loses at most
    the line being written)."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = Path(path)

    def emit(self, record: logging.LogRecord) -> None:
        line = metric_line(record.msg, getattr(record, "step", None))
        if line is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        except OSError:
            self.handleError(record)


def process_rank(environ: Mapping[str, str]) -> int:
    """This process's global rank as torchrun sets it (0 when not launched by torchrun)."""
    return int(environ.get("RANK", "0") or 0)


def install_metric_handler(path: Path | None, rank: int) -> bool:
    """Add the JSONL handler to ``speculators.metrics`` in rank 0 (the ranks log the same all-reduced values).

    speculators' ``setup_metric_logger`` configures that logger with ``dictConfig``, which removes the handlers
    it finds there: the handler is added right after it, by wrapping the name ``cli.main`` calls. True when
    installed.
    """
    if path is None or rank != 0:
        return False
    import inspect

    import speculators.train.cli as cli

    # checked now, not found out after hours of training when metrics.csv would be empty
    if "setup_metric_logger(" not in inspect.getsource(cli.main):
        raise RuntimeError(
            "speculators.train.cli.main no longer calls setup_metric_logger, after which the workflow adds its "
            "metrics handler: the installed speculators differs from 0.9.0; update eagle3_workflow/trainer/entry.py"
        )
    configure = cli.setup_metric_logger

    def configure_then_add_jsonl(*args: Any, **kwargs: Any) -> None:
        configure(*args, **kwargs)
        logging.getLogger(METRICS_LOGGER).addHandler(JsonlMetricHandler(path))

    cli.setup_metric_logger = configure_then_add_jsonl
    return True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    metrics_path = os.environ.get(METRICS_ENV)
    install_metric_handler(Path(metrics_path) if metrics_path else None, process_rank(os.environ))
    from eagle3_workflow.trainer.interrupt import apply_interrupt_patches

    apply_interrupt_patches()
    if os.environ.get(ONLINE_SPEC_ENV):
        from eagle3_workflow.trainer.online_samples import apply_online_patches

        apply_online_patches()
    if os.environ.get(DEVICE_ENV) == "cpu":
        from eagle3_workflow.trainer.cpu_shim import apply_cpu_patches, with_cpu_defaults

        apply_cpu_patches()
        argv = with_cpu_defaults(argv)
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    if os.environ.get(DEVICE_ENV) == "cpu":
        freeze_imported_heap()
    train_main(TrainConfig.resolve(argv))


def freeze_imported_heap() -> None:
    """CPU only: leave the objects the imports built (torch, transformers, speculators: ~593,000) out of later
    garbage collections (``gc.freeze()``).

    speculators' ``cli.main`` collects in full after training (``gc.collect()`` before it empties an accelerator's
    cache), a walk over that whole heap in every trainer process: 0.27-0.48 s against 0.003-0.007 s frozen, in each
    process of the tiny run (one, or each of two ranks), of a 4.9-5.8 s process on 2 cores
    (bench/suite/bench_trainer_start.py, 2026-12-06). The imported modules live until the process exits anyway, and a
    collection frees unreachable cycles only: the trainer, the draft and the batches are built after the freeze and
    are collected as before, so no value computed changes (the tiny run's losses, accuracies and learning rates were
    identical, one process and two ranks). On CUDA the collection precedes ``empty_cache`` and the entry leaves it
    exactly as speculators runs it."""
    import gc

    gc.freeze()
    print(f"{FROZEN_LINE}: {gc.get_freeze_count()} objects", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
