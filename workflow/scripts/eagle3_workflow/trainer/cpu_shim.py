"""Run speculators' real ``speculators train`` on a machine with no accelerator (speculators 0.9.0).

Used by the trainer entry (``python -m eagle3_workflow.trainer.entry`` with ``EAGLE3_TRAIN_DEVICE=cpu``).

The trainer assumes an accelerator in a few places; this module patches exactly those and nothing else, so
config resolution, the vocab mapping, the dataset and dataloader, the loss, the optimizer, the scheduler and
checkpointing/resume are speculators' own code:

- ``Trainer`` moves the model and every batch to ``get_local_rank()`` (the int 0, which torch reads as the
  accelerator) -> the string ``"cpu"``;
- ``Trainer.__init__`` sets the autocast device type to ``"cuda"`` when there is no accelerator -> ``"cpu"``;
- the step timer calls ``torch.accelerator.synchronize()`` unconditionally -> a no-op without an accelerator;
- resuming loads the checkpoint onto ``get_current_device()``, which is ``"cuda:0"`` without an
  accelerator -> ``"cpu"`` (without this, a resumed CPU run dies in ``safe_open``);
- the draft's mask token id is resolved from ``load_processor(target)`` (``AutoProcessor``), which for a multimodal
  target (Kimi-K2.5) also builds its image processor, and that needs torchvision, which the CPU environment does
  not have (envs/setup_cpu.sh removes it: PyPI's build breaks ``import vllm`` beside CPU torch). The trainer uses
  that processor for its tokenizer only (``get_tokenizer``) -> the target's tokenizer itself (``AutoTokenizer``,
  the pad token resolved as speculators does); a text-only target's processor is that tokenizer anyway.

- under torchrun (``train.cpu_processes`` > 1), ``distributed.maybe_setup_distributed`` (the name ``cli.main``
  calls) picks its backend from the accelerator and binds each rank to device ``LOCAL_RANK``: with none it raises
  "No accelerator found". While it runs, the accelerator it asks for is the CPU (torch's default backend for it is
  gloo) and ``init_process_group`` gets no ``device_id`` (a CPU process group binds no device); speculators' own
  function still creates the process groups and the topology every other module reads, and the trainer then wraps
  the model in DDP exactly as on GPUs (``Trainer._setup_model_ddp``).

Flex attention has no CPU backward and the fused loss needs Triton: ``--draft-attn-impl sdpa`` and
``--loss-implementation eager`` are added when the command line does not choose them.

The patch points (and the one the trainer entry wraps to add its metrics handler) are listed in
``SHIM_PATCH_POINTS`` so that the API gate can check they still exist in the
installed versions before anything long runs (``shim_patch_points_present``).
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

# (module, attribute path inside it) of every object this shim replaces or calls into
SHIM_PATCH_POINTS: list[tuple[str, str]] = [
    ("speculators.train.trainer", "get_local_rank"),
    ("speculators.train.trainer", "Trainer.__init__"),
    ("speculators.train.checkpointer", "get_current_device"),
    ("torch.accelerator", "synchronize"),
    ("torch.accelerator", "is_available"),
    ("speculators.train.cli", "main"),
    ("speculators.train.cli", "setup_metric_logger"),  # trainer.entry.install_metric_handler
    ("speculators.train.config", "TrainConfig.resolve"),
    ("speculators.train.utils", "load_processor"),
    ("speculators.train.cli", "maybe_setup_distributed"),
    ("torch.accelerator", "set_device_index"),
    ("torch.accelerator", "current_accelerator"),
    ("torch.distributed", "init_process_group"),
    ("torch.distributed", "get_default_backend_for_device"),
]

# speculators train options a CPU run needs, added when the command line does not set them
CPU_DEFAULT_ARGS: dict[str, str] = {
    "--draft-attn-impl": "sdpa",
    "--loss-implementation": "eager",
}

_PATCHED_MARKER = "_eagle3_cpu_shim"


def _resolve(module_name: str, attribute_path: str) -> Any:
    obj: Any = importlib.import_module(module_name)
    for part in attribute_path.split("."):
        obj = getattr(obj, part)
    return obj


def shim_patch_points_present() -> list[tuple[str, bool, str]]:
    """For each patch point: (``module:attribute``, present, signature or the error found)."""
    rows: list[tuple[str, bool, str]] = []
    for module_name, attribute_path in SHIM_PATCH_POINTS:
        name = f"{module_name}:{attribute_path}"
        try:
            obj = _resolve(module_name, attribute_path)
        except (ImportError, AttributeError) as exc:
            rows.append((name, False, repr(exc)))
            continue
        try:
            detail = f"{attribute_path.rsplit('.', 1)[-1]}{inspect.signature(obj)}"
        except (TypeError, ValueError):
            detail = type(obj).__name__
        rows.append((name, callable(obj), detail))
    return rows


def with_cpu_defaults(argv: list[str]) -> list[str]:
    """argv plus the CPU-capable attention and loss implementations unless argv chooses its own."""
    out = list(argv)
    for flag, value in CPU_DEFAULT_ARGS.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            out += [flag, value]
    return out


def apply_cpu_patches() -> None:
    """Patch the accelerator assumptions of speculators' trainer (idempotent)."""
    import torch

    missing = [name for name, present, _ in shim_patch_points_present() if not present]
    if missing:
        raise RuntimeError(
            f"the CPU training shim cannot patch {missing}: the installed speculators/torch differ from the "
            "versions it was written for (speculators 0.9.0, torch 2.13); update cpu_train_shim.py"
        )
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import speculators.train.utils as train_utils

    if getattr(trainer.Trainer, _PATCHED_MARKER, False):
        return
    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None

    original_init: Callable[..., None] = trainer.Trainer.__init__

    def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = init_on_cpu
    train_utils.load_processor = target_tokenizer
    import speculators.train.cli as cli

    cli.maybe_setup_distributed = distributed_on_cpu(cli.maybe_setup_distributed)
    setattr(trainer.Trainer, _PATCHED_MARKER, True)


def target_tokenizer(target_model_path: str, *, trust_remote_code: bool) -> Any:
    """What speculators' trainer reads of the target's processor, its tokenizer, without an image processor
    (speculators.data_generation.preprocessing.load_processor's pad-token rule kept)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_model_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def distributed_on_cpu(setup: Callable[..., None]) -> Callable[..., None]:
    """speculators' ``maybe_setup_distributed`` for ranks with no accelerator: gloo, no device binding."""

    def setup_on_cpu(*args: Any, **kwargs: Any) -> None:
        import torch
        import torch.distributed as dist

        if "LOCAL_RANK" not in os.environ or torch.accelerator.is_available():
            setup(*args, **kwargs)  # one process (nothing to set up), or an accelerator: speculators' own path
            return
        accelerator, init = torch.accelerator, dist.init_process_group
        saved = (accelerator.set_device_index, accelerator.current_accelerator)

        def init_without_device(backend: str | None = None, *a: Any, device_id: Any = None, **kw: Any) -> None:
            del device_id  # LOCAL_RANK, meant as an accelerator index: a CPU process group binds no device
            init(backend, *a, **kw)

        accelerator.set_device_index = lambda *a, **kw: None
        accelerator.current_accelerator = lambda *a, **kw: torch.device("cpu")
        dist.init_process_group = init_without_device
        try:
            setup(*args, **kwargs)
        finally:
            accelerator.set_device_index, accelerator.current_accelerator = saved
            dist.init_process_group = init
        backend = dist.get_backend()
        if backend != "gloo":
            raise RuntimeError(f"the CPU ranks' process group uses {backend!r}, not gloo: update cpu_train_shim.py")

    return setup_on_cpu
