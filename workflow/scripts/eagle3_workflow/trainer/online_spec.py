"""What train_draft (the stage) and the online trainer's dataset (``trainer.online_samples``) share about online hidden
states: the spec the trainer reads, the failures file and the per-process counts. Free of speculators: the stage
imports this, and importing speculators costs ~8 s on a 2-core machine (measured 2026-12-02), paid again by the
trainer it starts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

# the environment variables train_draft sets for the trainer: the spec (its JSON) and the key of the vLLM server
ONLINE_SPEC_ENV = "EAGLE3_ONLINE_SPEC"
API_KEY_ENV = "EAGLE3_VLLM_API_KEY"


class OnlineSampleFailure(RuntimeError):
    """More samples failed than train.online.max_failed_samples allows."""


@dataclasses.dataclass(frozen=True)
class OnlineSpec:
    """What the trainer's dataset checks and where it records (JSON in EAGLE3_ONLINE_SPEC)."""

    layer_count: int
    hidden_size: int
    dtype: str
    failures_path: str
    counts_dir: str
    max_failed_samples: int
    requests_in_flight: int  # at once per DataLoader worker (train.online.requests_in_flight)

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, text: str) -> OnlineSpec:
        return cls(**json.loads(text))


def failed_rows(failures_path: Path) -> dict[int, str]:
    """row -> its last recorded reason, from the failures file (absent: none)."""
    rows: dict[int, str] = {}
    if failures_path.exists():
        for line in failures_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                rows[int(record["row"])] = str(record["reason"])
    return rows


def record_failure(spec: OnlineSpec, row: int, reason: str) -> None:
    """Append the failed sample; raise OnlineSampleFailure when the distinct failed rows exceed the limit. ``row``
    may be a numpy integer: speculators' batch sampler yields each batch's indices as a numpy array."""
    path = Path(spec.failures_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"row": int(row), "reason": reason, "pid": os.getpid()}) + "\n")
    rows = failed_rows(path)
    if len(rows) > spec.max_failed_samples:
        listed = "; ".join(f"row {r}: {why[:300]}" for r, why in sorted(rows.items())[:5])
        raise OnlineSampleFailure(
            f"online hidden-state generation failed for {len(rows)} sample(s) after all retries, more than "
            f"train.online.max_failed_samples={spec.max_failed_samples}: {listed}. Every failure is in {path}. "
            "The vLLM server's log (train_draft's log, lines [vllm]) says why a request failed; a check that "
            "failed (shape, dtype, token ids, values) means the server captured something else than the "
            "canary proved. Raise train.online.max_failed_samples to train without these samples."
        )


def samples_checked(counts_dir: Path) -> tuple[int, int]:
    """(samples, tokens) checked by every trainer process so far."""
    samples = tokens = 0
    for path in sorted(counts_dir.glob("checked-*.json")) if counts_dir.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            counts = json.loads(path.read_text(encoding="utf-8"))
            samples, tokens = samples + int(counts["samples"]), tokens + int(counts["tokens"])
    return samples, tokens
