"""The artefacts stages hand to each other: small dataclasses written to JSON atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def write_json_atomic(path: str | Path, payload: Any) -> None:
    """Write JSON so that a reader sees the old file or the whole new one, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if dataclasses.is_dataclass(payload):
        payload = dataclasses.asdict(payload)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=False, default=str)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | Path) -> Any:
    with open(path) as handle:
        return json.load(handle)


def load_contract(cls: type[T], path: str | Path) -> T:
    """Read a contract back, ignoring keys a newer writer may have added."""
    data = read_json(path)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass
class CheckRow:
    """One line of a gate's table."""

    name: str
    expected: str
    found: str
    passed: bool
    detail: str = ""


def check_table(rows: list[CheckRow]) -> str:
    from eagle3_workflow.errors import render_table

    return render_table(
        ["check", "expected", "found", "pass"],
        [(r.name, r.expected, r.found, "PASS" if r.passed else "FAIL") for r in rows],
    )


@dataclasses.dataclass
class TargetInfo:
    path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


@dataclasses.dataclass
class DataManifest:
    records_read: int
    records_kept: int
    dropped: dict[str, int]
    truncated: int
    total_tokens: int
    assistant_tokens: int
    length_percentiles: dict[str, float]
    sources: list[str]
    max_seq_len: int
    prepared_dir: str
    token_freq_path: str


@dataclasses.dataclass
class ApiCompatReport:
    passed: bool
    vllm_version: str
    speculators_version: str
    transformers_version: str
    torch_version: str
    device: str
    layer_ids: list[int]
    checks: list[CheckRow]
    target: TargetInfo


@dataclasses.dataclass
class CanaryReport:
    passed: bool
    device: str
    canary_layers: int
    canary_layer_ids: list[int]
    reference: str
    tolerance: float
    per_layer_max_rel_error: dict[str, float]
    per_layer_mean_rel_error: dict[str, float]
    samples: int
    server_ready_s: float
    checks: list[CheckRow]


@dataclasses.dataclass
class ExtractionManifest:
    replica: int
    replicas: int
    samples_total: int
    samples_extracted: int
    samples_reused: int
    tokens: int
    bytes_written: int
    wall_s: float
    server_ready_s: float
    tokens_per_s: float
    files_dir: str
    rows: list[int]


@dataclasses.dataclass
class ProgressSnapshot:
    state: str  # starting | running | done | failed
    replica: int
    samples_done: int
    samples_total: int
    tokens_done: int
    tokens_per_s: float
    eta_s: float | None
    updated_unix: float
    message: str = ""


@dataclasses.dataclass
class ValidationReport:
    passed: bool
    samples_expected: int
    samples_valid: int
    missing: list[int]
    bad: dict[str, str]
    tokens: int
    bytes: int
    layer_count: int
    hidden_size: int
    files_dir: list[str]


@dataclasses.dataclass
class AcceptanceResult:
    label: str
    mean_acceptance_length: float
    per_position_acceptance: list[float]
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_s: float


@dataclasses.dataclass
class AcceptanceReport:
    num_prompts: int
    prompt_source: str
    num_speculative_tokens: int
    max_tokens: int
    trained: AcceptanceResult
    untrained: AcceptanceResult
    no_speculation_tokens_per_s: float
    lossless: bool
    lossless_mismatches: int
