"""GPU placement for local runs: each GPU job holds exactly `resources.gpu` devices for its lifetime.

Snakemake's local executor counts GPUs (`--resources gpu=N`) but never says which ones a job may use, so
without this every vLLM server and trainer of a run would start on GPU 0. A job here takes its devices with
`fcntl.flock` on one lock file per device and exposes only them through CUDA_VISIBLE_DEVICES, which the
processes it starts inherit (runtime.child_environment copies os.environ). The kernel drops a flock when the
last descriptor of the holding process closes: on success, on an exception, on SIGTERM and on SIGKILL, so a
dead job never leaves a device taken (a counter or a pid file would). Lock files are never deleted: removing one
while another job waits on it would let two jobs lock two different inodes of the same name.

Under a scheduler (SLURM sets SLURM_JOB_ID and the allocation's CUDA_VISIBLE_DEVICES) the allocation is the
job's: nothing is reassigned. Only where one allocation holds more devices than the job asks (several Snakemake
jobs inside one `salloc`) are they shared out among its jobs the same way, under a per-allocation lock name.

Policy when a device is busy: within one Snakemake run `--resources gpu=<count>` already keeps the jobs' total
within the machine, so a busy device means another run on this machine, or a run started without
`--resources gpu` (Snakemake then does not limit GPU jobs at all). The job waits up to
`wait_timeout_s`, logging who holds the devices, then fails with that advice. A machine with fewer devices than
the job asks fails at once: waiting cannot help.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from eagle3_workflow.settings.errors import StageError

DEFAULT_LOCK_DIR = "results/.gpu_locks"
POLL_INTERVAL_S = 1.0
WAIT_LOG_INTERVAL_S = 30.0
RESOURCE_NAME = "gpu_placement"


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    """What a job needs and where the locks live; built from the rule's resources (common.smk)."""

    gpus: int
    lock_dir: Path = Path(DEFAULT_LOCK_DIR)
    machine_gpus: int | None = None  # None: count them with nvidia-smi
    # gpu_placement.wait_timeout_s and vllm.device, from the resource; None where the job has none. Only a job that
    # locks devices needs them (a local GPU job, or one sharing a SLURM allocation): without them it is refused
    # (require_placement_resource); a CPU job, or one whose SLURM allocation is all its own, runs without.
    wait_timeout_s: float | None = None
    device: str | None = None  # decides what a machine without any GPU means

    @classmethod
    def from_resources(cls, resources: Any) -> PlacementSettings:
        gpus = int(getattr(resources, "gpu", 0) or 0)
        raw = getattr(resources, RESOURCE_NAME, None)
        if not gpus or not raw:
            return cls(gpus=gpus)
        given = json.loads(raw)
        return cls(
            gpus=gpus,
            lock_dir=Path(given["lock_dir"]),
            machine_gpus=given["machine_gpus"],
            wait_timeout_s=float(given["wait_timeout_s"]),
            device=given["device"],
        )


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a job gets its devices: `keep` = use the environment as it is; otherwise lock `count` of `pool`."""

    keep: bool
    pool: tuple[str, ...] = ()
    count: int = 0
    namespace: str = ""
    reason: str = ""


def count_machine_gpus(nvidia_smi_output: str) -> int:
    """Physical GPUs in `nvidia-smi -L` output (MIG slices are listed indented under their GPU)."""
    return sum(1 for line in nvidia_smi_output.splitlines() if re.match(r"GPU \d+:", line))


def detect_machine_gpus(log: logging.Logger) -> int:
    # nvidia-smi, not torch: initialising CUDA in this process would freeze its device list before
    # CUDA_VISIBLE_DEVICES is set, and the trainer counts devices in this same process
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return 0
    except subprocess.TimeoutExpired as exc:
        log.warning("gpu placement: nvidia-smi -L did not answer in 60 s (%r); counting 0 GPUs", exc)
        return 0
    if proc.returncode != 0:
        log.warning(
            "gpu placement: nvidia-smi -L failed (%d): %s; counting 0 GPUs", proc.returncode, proc.stderr[-500:]
        )
        return 0
    return count_machine_gpus(proc.stdout)


def device_list(value: str | None) -> list[str] | None:
    """A CUDA_VISIBLE_DEVICES-style list; None when unset, [] when it hides every device."""
    if value is None:
        return None
    ids = [part.strip() for part in value.split(",") if part.strip()]
    return [] if not ids or ids[0].startswith("-") else ids


def scheduler_plan(gpus: int, env: Mapping[str, str]) -> Plan | None:
    """The plan inside a SLURM allocation (None outside one): its devices are this job's."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    named = (device_list(env.get(v)) for v in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"))
    allocated = next((ids for ids in named if ids is not None), None)
    if allocated is None:  # a site without GPU gres variables: nothing to go by, nothing to change
        return Plan(keep=True, reason=f"SLURM job {job_id} names no GPU devices; the environment is used as it is")
    if len(allocated) < gpus:
        raise StageError(
            f"this job needs {gpus} GPU(s) but its SLURM allocation {job_id} exposes {len(allocated)} "
            f"({','.join(allocated) or 'none'}); request the GPUs with the job (the rule's resources.gpu, passed "
            "by the slurm executor as --gpus) or lower the config's GPU counts"
        )
    if len(allocated) == gpus:
        return Plan(keep=True, reason=f"SLURM job {job_id} allocated GPU(s) {','.join(allocated)}")
    return Plan(keep=False, pool=tuple(allocated), count=gpus, namespace=f"slurm{job_id}")


def require_placement_resource(settings: PlacementSettings) -> None:
    """A job that locks devices (on a local machine, or sharing a SLURM allocation) needs the values only the
    gpu_placement resource carries."""
    if settings.wait_timeout_s is None or settings.device is None:
        raise StageError(
            f"this job needs {settings.gpus} GPU(s) placed but has no {RESOURCE_NAME} resource to place them by: "
            "the workflow's GPU rules set it (gpu_resources in workflow/rules/common.smk); a rule of your own that "
            "asks for resources.gpu needs it too"
        )


def local_plan(settings: PlacementSettings, env: Mapping[str, str], machine_gpus: int) -> Plan:
    """The plan of a local job: lock `gpus` of the visible devices (CUDA_VISIBLE_DEVICES, if the user set one,
    restricts the run to those devices)."""
    require_placement_resource(settings)
    visible = device_list(env.get("CUDA_VISIBLE_DEVICES"))
    pool = visible if visible is not None and settings.machine_gpus is None else [str(i) for i in range(machine_gpus)]
    if not pool and settings.device != "cuda":
        return Plan(keep=True, reason=f"no GPU on this machine and vllm.device={settings.device}: the job runs on CPU")
    if len(pool) < settings.gpus:
        where = (
            "CUDA_VISIBLE_DEVICES exposes"
            if visible is not None and settings.machine_gpus is None
            else "this machine has"
        )
        raise StageError(
            f"this job needs {settings.gpus} GPU(s) but {where} {len(pool)}; lower the config's GPU counts "
            "(extraction.gpus_per_replica, train.gpus, evaluate.gpus) or run on a machine with more GPUs"
        )
    return Plan(keep=False, pool=tuple(pool), count=settings.gpus, namespace="")


def plan_placement(settings: PlacementSettings, env: Mapping[str, str], machine_gpus: Callable[[], int]) -> Plan:
    """Pure decision (the machine count is asked for only when it matters)."""
    if settings.gpus <= 0:
        return Plan(keep=True, reason="the job uses no GPU")
    from_scheduler = scheduler_plan(settings.gpus, env)
    if from_scheduler is not None:
        return from_scheduler
    count = settings.machine_gpus if settings.machine_gpus is not None else machine_gpus()
    return local_plan(settings, env, count)


def lock_path(lock_dir: Path, namespace: str, device: str) -> Path:
    # the host in the name: results/ may be on a file system several nodes share
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", device)
    parts = [socket.gethostname(), namespace, f"gpu{safe}"]
    return lock_dir / ("-".join(p for p in parts if p) + ".lock")


def try_lock(path: Path) -> int | None:
    """An open, flock-ed descriptor of `path`, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def try_take(plan: Plan, lock_dir: Path) -> dict[str, int] | None:
    """All `plan.count` devices or none (holding some while waiting for others could deadlock two jobs)."""
    held: dict[str, int] = {}
    for device in plan.pool:
        fd = try_lock(lock_path(lock_dir, plan.namespace, device))
        if fd is not None:
            held[device] = fd
            if len(held) == plan.count:
                return held
    release(held)
    return None


def release(held: Mapping[str, int]) -> None:
    for fd in held.values():
        os.close(fd)


def record_holder(held: Mapping[str, int], holder: str) -> None:
    """Who holds a device, for the waiting job's message (information only: the lock is the flock)."""
    for fd in held.values():
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)


def holders(plan: Plan, lock_dir: Path) -> str:
    """Each device of the pool: 'free', or who holds it (a killed holder's text stays in the file: the lock
    decides, not the text)."""
    rows = []
    for device in plan.pool:
        path = lock_path(lock_dir, plan.namespace, device)
        fd = try_lock(path)
        if fd is not None:
            os.close(fd)
            rows.append(f"GPU {device}: free")
        else:
            rows.append(f"GPU {device}: {path.read_text(errors='replace').strip() or 'held'}")
    return "; ".join(rows)


def wait_for_devices(plan: Plan, lock_dir: Path, timeout_s: float, log: logging.Logger) -> dict[str, int]:
    start = time.monotonic()
    next_log = start
    while True:
        held = try_take(plan, lock_dir)
        if held is not None:
            return held
        now = time.monotonic()
        if now - start >= timeout_s:
            raise StageError(
                f"this job needs {plan.count} of GPU(s) {','.join(plan.pool)} but they stayed busy for "
                f"{timeout_s:.0f} s ({holders(plan, lock_dir)}). If those are jobs of this same run, Snakemake was "
                f"started without a GPU limit: pass --resources gpu={len(plan.pool)} so it never runs more GPU jobs "
                "than the machine has. If another run holds them, wait for it or raise gpu_placement.wait_timeout_s"
            )
        if now >= next_log:
            log.info("gpu placement: waiting for %d free GPU(s): %s", plan.count, holders(plan, lock_dir))
            next_log = now + WAIT_LOG_INTERVAL_S
        time.sleep(POLL_INTERVAL_S)


@contextlib.contextmanager
def hold_gpus(
    settings: PlacementSettings,
    log: logging.Logger,
    *,
    job: str = "",
    env: MutableMapping[str, str] | None = None,
) -> Iterator[list[str]]:
    """Hold the job's GPUs and expose only them (CUDA_VISIBLE_DEVICES) until the block ends; yields their ids
    ([] when nothing was placed)."""
    environ = os.environ if env is None else env
    plan = plan_placement(settings, environ, lambda: detect_machine_gpus(log))
    if plan.keep:
        if settings.gpus > 0:
            log.info("gpu placement: nothing to assign (%s)", plan.reason)
        yield device_list(environ.get("CUDA_VISIBLE_DEVICES")) or []
        return
    require_placement_resource(settings)
    settings.lock_dir.mkdir(parents=True, exist_ok=True)
    held = wait_for_devices(plan, settings.lock_dir, settings.wait_timeout_s, log)
    devices = sorted(held, key=plan.pool.index)
    saved = {name: environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    try:
        record_holder(held, f"pid {os.getpid()} on {socket.gethostname()}, {job or 'a job'}, since {time.ctime()}")
        environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the ids are nvidia-smi's, which CUDA's default order is not
        log.info(
            "gpu placement: holding GPU(s) %s of %s (CUDA_VISIBLE_DEVICES=%s; locks in %s)",
            ",".join(devices),
            ",".join(plan.pool),
            ",".join(devices),
            settings.lock_dir,
        )
        yield devices
    finally:
        restore(environ, saved)
        release(held)


def restore(environ: MutableMapping[str, str], saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def holding_gpus(snakemake: Any) -> Callable[[Callable[[logging.Logger], Any]], Callable[[logging.Logger], Any]]:
    """Decorator for a stage body (`@holding_gpus(snakemake)` above `def body(log)`): the body runs holding the
    rule's `resources.gpu` devices, and run_stage reports a placement failure like any other."""

    def wrap(body: Callable[[logging.Logger], Any]) -> Callable[[logging.Logger], Any]:
        @functools.wraps(body)
        def held(log: logging.Logger) -> Any:
            settings = PlacementSettings.from_resources(snakemake.resources)
            with hold_gpus(settings, log, job=job_name(snakemake)):
                return body(log)

        return held

    return wrap


def job_name(snakemake: Any) -> str:
    wildcards = getattr(snakemake, "wildcards", None)
    pairs: Sequence[str] = [f"{k}={v}" for k, v in wildcards.items()] if wildcards else []
    return f"rule {getattr(snakemake, 'rule', '')}" + (f" ({', '.join(pairs)})" if pairs else "")
