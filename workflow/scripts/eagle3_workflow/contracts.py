"""The artefacts stages hand to each other: small dataclasses written to JSON atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def process_umask() -> int:
    """The umask, read without changing it (os.umask's read-by-setting races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_as_umask_allows(root: str | Path) -> None:
    """Give every file (and folder) under `root` the permissions a plain open() would have given it.

    safetensors >= 0.8 writes through a private temporary file, so every save_file / save_pretrained leaves
    model.safetensors 0600 whatever the umask; mkstemp/mkdtemp do the same. A target, draft or hidden-state
    file that only its writer can read breaks jobs that run as another user of the group.
    """
    umask = process_umask()
    root = Path(root)
    for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if path.is_symlink():
            continue
        allowed = (0o777 if path.is_dir() else 0o666) & ~umask
        mode = path.stat().st_mode & 0o7777
        if mode | allowed != mode:
            path.chmod(mode | allowed)


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
        os.chmod(tmp, 0o666 & ~process_umask())  # mkstemp creates 0600; artefacts are meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def published_directory(out_dir: str | Path) -> Iterator[Path]:
    """Fill a private staging folder beside out_dir, then swap it in whole: a reader (or a failed run) sees the
    old folder or the complete new one, never a half-written one. Files get the permissions the umask allows
    (mkdtemp and safetensors make them private; a draft is for others to serve)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        yield staging
        share_as_umask_allows(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
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
    # per captured id: the reference layer nearest to its slot (of all 0..K and post-norm), the runner-up, the
    # relative distances and their ratio (margin); the `layer-id convention` row fails when best != the id
    layer_matches: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


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
    # the server's greedy next token (+ top logprobs) after a few samples; validate_hidden_states recomputes it
    # from the captured last state through the target's final norm and lm_head
    greedy_probes: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ProgressSnapshot:
    state: str  # starting | running | done | failed | stalled (server alive, no sample finished in time)
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
    greedy_check: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclasses.dataclass
class LosslessMismatch:
    """The first generated token where a speculative run's greedy output differs from the run without
    speculation (one per prompt that differs)."""

    prompt_index: int
    origin: str
    position: int  # index into the generated tokens
    expected_token: int | None  # None: the run without speculation stopped here
    found_token: int | None  # None: the speculative run stopped here
    logprob_gap: float | None  # reference logprob(expected) - logprob(found); None: found not in its top-k
    tolerated: bool  # a numerical near-tie within evaluate.lossless_logprob_tolerance
    context: str  # the generated text just before the divergence
    expected_text: str
    found_text: str


@dataclasses.dataclass
class AcceptanceResult:
    """One draft served by vLLM on the evaluation prompts (greedy), from vLLM's spec-decode counters."""

    label: str  # trained | untrained
    draft_path: str
    mean_acceptance_length: float  # tokens per verification step incl. the bonus token = 1 + accepted / drafts
    per_position_acceptance: list[float]  # accepted at draft position i / drafts
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_s: float
    accepted_per_position: list[int]
    draft_acceptance_rate: float  # accepted / draft tokens
    generated_tokens: int
    generate_s: float
    speedup: float  # tokens_per_s / tokens_per_s without speculation, same prompts, same process
    engine_start_s: float
    lossless: bool
    mismatches: list[LosslessMismatch]

    def __post_init__(self) -> None:
        self.mismatches = [
            m if isinstance(m, LosslessMismatch) else LosslessMismatch(**_known_fields(LosslessMismatch, m))
            for m in self.mismatches
        ]


@dataclasses.dataclass
class MeasurementProcess:
    """One process that started vLLM engines for the evaluation (CPU: one for all; GPU: one per engine)."""

    runs: list[str]
    wall_s: float  # the whole process: vLLM import, engine starts, generation, teardown
    vllm_import_s: float
    engine_start_s: dict[str, float]
    load_1m: float  # host load average when it ended (CPU timings on a shared host are noisy)


@dataclasses.dataclass
class AcceptanceReport:
    """eval/acceptance.json. Written only when every speculative run was lossless."""

    num_prompts: int
    prompt_source: str
    num_speculative_tokens: int
    max_tokens: int
    trained: AcceptanceResult
    untrained: AcceptanceResult
    no_speculation_tokens_per_s: float
    lossless: bool
    lossless_mismatches: int  # mismatches counted over both drafts (tolerated near-ties included)
    num_prompts_requested: int
    prompt_detail: str  # where the prompts came from (rows, file, package)
    device: str
    vllm_version: str
    no_speculation_generated_tokens: int
    no_speculation_generate_s: float
    no_speculation_engine_start_s: float
    lossless_logprob_tolerance: float
    untrained_baseline: str  # how the untrained draft was built, and whether its frozen tensors match
    processes: list[MeasurementProcess]
    notes: list[str]
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # where answers ended (eos + end-of-turn)
    stop_strings: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.processes = [
            p if isinstance(p, MeasurementProcess) else MeasurementProcess(**_known_fields(MeasurementProcess, p))
            for p in self.processes
        ]
        for name in ("trained", "untrained"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, AcceptanceResult(**_known_fields(AcceptanceResult, value)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcceptanceReport:
        return cls(**_known_fields(cls, data))
