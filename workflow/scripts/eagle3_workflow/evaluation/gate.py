"""The lock file that measurement processes running at once share (``evaluate.concurrent_processes``,
``MeasurementSpec.lock_path``): each process holds it shared while it imports vLLM, starts an engine, warms it up
and runs a lossless pass, and exclusive for a timing pass, so tokens/s are measured while no other process
compiles, captures graphs or generates (measure runs its phases through a Gate). Pure: fcntl only."""

from __future__ import annotations

import fcntl
import os
import time
from typing import Literal

from eagle3_workflow.evaluation.protocol import LOG_PREFIX

LockMode = Literal["shared", "exclusive"]
# what each phase of a measurement process holds the lock as: a timing pass (its warm-up and measured passes)
# alone, everything else beside the others' imports, starts and lossless passes
LOCK_MODES: dict[str, LockMode] = {
    "import": "shared",
    "engine_start": "shared",
    "lossless": "shared",
    "timing": "exclusive",
}


class Gate:
    """The lock file that processes measuring at once share (fcntl.flock; the kernel drops it when the process ends,
    however it ends). `hold(phase)` takes it in that phase's mode (LOCK_MODES), releasing the other mode first, so a
    process that waits for the lock holds none of it: two processes that each kept their shared lock while asking
    for the exclusive one would wait for each other. The lock is never given back between phases of the same mode,
    nor at the end: the process's teardown (engine shutdown, CUDA context) keeps whatever it holds. `waited_s` sums
    the seconds spent waiting for each mode. No path: no lock, every call a no-op."""

    def __init__(self, path: str | None, prefix: str = LOG_PREFIX):
        self.path, self.prefix = path, prefix
        self.mode: LockMode | None = None
        self.waited_s: dict[str, float] = {}
        self._fd: int | None = None

    @property
    def active(self) -> bool:
        return self.path is not None

    def hold(self, phase: str) -> None:
        mode = LOCK_MODES[phase]
        if self.path is None or self.mode == mode:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if self.mode is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.mode = None
        started = time.perf_counter()
        fcntl.flock(self._fd, fcntl.LOCK_SH if mode == "shared" else fcntl.LOCK_EX)
        waited = time.perf_counter() - started
        self.mode = mode
        self.waited_s[mode] = round(self.waited_s.get(mode, 0.0) + waited, 3)
        print(f"{self.prefix}lock {mode} for {phase} after {waited:.1f} s", flush=True)
