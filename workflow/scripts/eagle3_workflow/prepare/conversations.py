"""Stage `prepare_data`: conversations -> speculators' training layout, loss masks, token frequencies.

Reads ShareGPT (``conversations`` with ``from``/``value``), OpenAI-style ``messages`` (json / jsonl) and
parquet with either column. Writes ``prepared/`` (a HF dataset with ``input_ids``, ``loss_mask``,
``seq_len`` in torch format, which ``speculators train`` loads), ``token_freq.pt`` (assistant-token counts,
speculators' format) and ``manifest.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_workflow.files.chat import TemplateError, normalize_messages, tokenize_conversation
from eagle3_workflow.files.data_artefacts import DataManifest
from eagle3_workflow.prepare.repetition import most_repeated_answer
from eagle3_workflow.settings.errors import StageError, render_table
from eagle3_workflow.settings.sections import DataPreparation

log = logging.getLogger("eagle3.prepare")

MAX_REPORTED_BAD = 20


@dataclasses.dataclass
class RawRecord:
    source: str
    line: int  # 1-based line (jsonl), element index (json array) or row (parquet)
    payload: Any


@dataclasses.dataclass
class BadRecord:
    source: str
    line: int
    reason: str
    detail: str

    def where(self) -> str:
        return f"{self.source}:{self.line}"


def detect_format(path: Path, declared: str) -> str:
    if declared != "auto":
        return declared
    if path.suffix == ".parquet":
        return "parquet"
    return "json"  # sharegpt vs messages is decided per record


def read_records(path: Path, declared_format: str) -> Iterator[RawRecord | BadRecord]:
    """Yield raw records, or BadRecord for text that does not parse (with file and line)."""
    fmt = detect_format(path, declared_format)
    if not path.exists():
        raise StageError(f"data source {path} does not exist; fix data.sources in the config")
    if fmt == "parquet" or path.suffix == ".parquet":
        import pandas as pd

        frame = pd.read_parquet(path)
        for i, row in enumerate(frame.to_dict(orient="records")):
            yield RawRecord(str(path), i + 1, _from_parquet_row(row))
        return
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[":
        yield from _json_array_records(path, data)
        return
    # decoded line by line: one bad byte is one bad record (with its line), not a crash of the whole file
    for lineno, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield BadRecord(str(path), lineno, "not_utf8", f"byte {raw[exc.start]:#04x} at column {exc.start + 1}")
            continue
        if not line.strip():
            continue
        try:
            yield RawRecord(str(path), lineno, json.loads(line))
        except json.JSONDecodeError as exc:
            yield BadRecord(str(path), lineno, "malformed_json", repr(exc))


def _json_array_records(path: Path, data: bytes) -> Iterator[RawRecord | BadRecord]:
    """A .json array is one document: a bad byte or bad syntax makes it one bad record, at its line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        yield BadRecord(str(path), line, "not_utf8", f"byte {data[exc.start]:#04x}; the whole JSON array is unread")
        return
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        yield BadRecord(str(path), exc.lineno, "malformed_json", repr(exc))
        return
    for i, item in enumerate(items):
        yield RawRecord(str(path), i + 1, item)


def _from_parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    # parquet nested columns come back as numpy arrays of dicts
    out = {}
    for key, value in row.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        out[key] = value
    return out


class RecordError(ValueError):
    """A record that cannot be trained on; `reason` is its key in manifest.json's `dropped`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


FORMAT_KEYS = {"sharegpt": "conversations", "messages": "messages"}


def messages_of(record: RawRecord, declared_format: str) -> list[dict[str, str]]:
    payload = record.payload
    if not isinstance(payload, dict):
        raise RecordError("invalid_record", f"record is {type(payload).__name__}, expected an object")
    fitting = [fmt for fmt, key in FORMAT_KEYS.items() if key in payload]
    accepted = list(FORMAT_KEYS) if declared_format in ("auto", "parquet") else [declared_format]
    usable = [fmt for fmt in accepted if fmt in fitting]
    if not usable:
        if fitting:
            raise RecordError(
                "format_mismatch",
                f"the declared format {declared_format!r} does not match this record: it has "
                f"{FORMAT_KEYS[fitting[0]]!r}, which is format {fitting[0]!r}; set format: {fitting[0]} "
                "(or auto) for this file in data.sources",
            )
        raise RecordError(
            "invalid_record",
            f"record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {sorted(payload)}",
        )
    fmt = usable[0]
    role_key, content_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
    try:
        messages = normalize_messages(payload[FORMAT_KEYS[fmt]], role_key=role_key, content_key=content_key)
    except ValueError as exc:
        reason = "no_assistant_turn" if "no assistant turn" in str(exc) else "invalid_record"
        raise RecordError(reason, str(exc)) from exc
    empty = [
        f"turn {j} ({m['role']})" for j, m in enumerate(messages) if m["role"] != "system" and not m["content"].strip()
    ]
    if empty:
        # an empty answer trains only the end-of-turn token; an empty question teaches answering nothing
        raise RecordError("empty_turn", f"{', '.join(empty)} empty; fill or remove the record")
    return messages


@dataclasses.dataclass
class PreparedSample:
    input_ids: list[int]
    loss_mask: list[int]
    messages: list[dict[str, str]]
    source: str
    line: int
    truncated: bool = False  # cut at max_seq_len (and kept)


@dataclasses.dataclass
class PreparationResult:
    samples: list[PreparedSample]
    manifest_counts: dict[str, Any]
    bad_records: list[BadRecord]


@dataclasses.dataclass
class RecordPolicy:
    max_seq_len: int
    overlength: str  # truncate | drop
    min_assistant_tokens: int
    max_repeated_share: float | None  # None: no answer is judged for repetition


def prepare_record(
    item: RawRecord, declared: str, tokenizer: Any, policy: RecordPolicy
) -> PreparedSample | BadRecord | str:
    """One record's single outcome: a sample (maybe truncated), a bad record, or the name of a plain drop."""
    try:
        messages = messages_of(item, declared)
        if policy.max_repeated_share is not None and most_repeated_answer(messages) > policy.max_repeated_share:
            return "repetitive"
        tokenized = tokenize_conversation(tokenizer, messages)
    except RecordError as exc:
        return BadRecord(item.source, item.line, exc.reason, str(exc))
    except TemplateError as exc:
        return BadRecord(item.source, item.line, "template_error", str(exc))
    ids, mask = tokenized.input_ids, tokenized.loss_mask
    truncated = len(ids) > policy.max_seq_len
    if truncated:
        if policy.overlength == "drop":
            return "overlength"
        ids, mask = ids[: policy.max_seq_len], mask[: policy.max_seq_len]
    if sum(mask) < policy.min_assistant_tokens:
        return BadRecord(
            item.source,
            item.line,
            "no_assistant_tokens",
            f"{sum(mask)} assistant tokens kept (minimum {policy.min_assistant_tokens}) of "
            f"{len(tokenized.input_ids)} tokens; max_seq_len={policy.max_seq_len}",
        )
    return PreparedSample(ids, mask, messages, item.source, item.line, truncated)


def bad_record_table(bad: list[BadRecord]) -> str:
    shown = bad[:MAX_REPORTED_BAD]
    table = render_table(["where", "reason", "detail"], [(b.where(), b.reason, b.detail) for b in shown])
    more = f"\n... and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
    return table + more


def prepare_conversations(
    sources: list[tuple[Path, str]], tokenizer: Any, settings: DataPreparation
) -> PreparationResult:
    """Parse, render, mask, length- and repetition-filter every record. Pure: no files are written.

    Every record read ends under exactly one outcome: kept, or one reason in `dropped`; `truncated` counts
    the kept records that were cut at max_seq_len.
    """
    policy = RecordPolicy(
        settings.max_seq_len, settings.overlength, settings.min_assistant_tokens, settings.max_repeated_share
    )
    kept: list[PreparedSample] = []
    bad: list[BadRecord] = []
    dropped: collections.Counter[str] = collections.Counter()
    records_read = 0
    for path, declared in sources:
        read_here = 0
        for item in read_records(path, declared):
            read_here += 1
            outcome = item if isinstance(item, BadRecord) else prepare_record(item, declared, tokenizer, policy)
            if isinstance(outcome, BadRecord):
                bad.append(outcome)
            elif isinstance(outcome, str):
                dropped[outcome] += 1
            else:
                kept.append(outcome)
        if not read_here:
            raise StageError(
                f"data source {path} holds no record (the file is empty); fix or remove it in data.sources"
            )
        records_read += read_here

    if bad and settings.on_bad_record == "fail":
        raise StageError(
            f"{len(bad)} bad record(s) in the input data:\n{bad_record_table(bad)}\n"
            "Fix the records, or set data.on_bad_record: skip to drop them (they are then counted in "
            "data/manifest.json under dropped)."
        )
    for b in bad:
        dropped[b.reason] += 1

    if not kept:
        table = f"\n{bad_record_table(bad)}" if bad else ""
        raise StageError(
            f"no record survived preparation ({records_read} read; dropped by reason: {dict(dropped)}). "
            f"Check data.sources, the record format, data.max_seq_len and the tokenizer's chat template.{table}"
        )
    rng = random.Random(settings.seed)
    rng.shuffle(kept)  # speculators splits train/validation by position: shuffle before that
    max_samples = settings.max_samples
    if max_samples is not None and len(kept) > max_samples:
        dropped["max_samples"] += len(kept) - max_samples
        kept = kept[:max_samples]
    counts = {"records_read": records_read, "dropped": dict(dropped), "truncated": sum(s.truncated for s in kept)}
    return PreparationResult(kept, counts, bad)


def percentiles(values: list[int]) -> dict[str, float]:
    import numpy as np

    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in (0, 10, 50, 90, 99, 100)} | {"mean": float(arr.mean())}


def token_frequencies(samples: list[PreparedSample]) -> dict[int, int]:
    """Counts of assistant tokens only, as speculators' save_token_frequency_distribution computes."""
    counter: collections.Counter[int] = collections.Counter()
    for sample in samples:
        counter.update(t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m)
    return dict(counter)


def write_prepared(result: PreparationResult, out_dir: Path, token_freq_path: Path) -> None:
    """The layout speculators' trainer reads: a HF dataset saved to disk, torch format."""
    import datasets
    import torch

    rows = {
        "input_ids": [s.input_ids for s in result.samples],
        "loss_mask": [s.loss_mask for s in result.samples],
        "seq_len": [len(s.input_ids) for s in result.samples],
        # kept for the canary (server-side rendering check) and for held-out evaluation prompts
        "messages": [json.dumps(s.messages) for s in result.samples],
        "origin": [f"{s.source}:{s.line}" for s in result.samples],
    }
    dataset = datasets.Dataset.from_dict(rows)
    dataset.set_format("torch", columns=["input_ids", "loss_mask", "seq_len"], output_all_columns=True)
    dataset.save_to_disk(str(out_dir))
    token_freq_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(token_frequencies(result.samples), token_freq_path)


def build_manifest(
    result: PreparationResult, sources: list[str], max_seq_len: int, prepared_dir: Path, token_freq_path: Path
) -> DataManifest:
    lengths = [len(s.input_ids) for s in result.samples]
    return DataManifest(
        records_read=result.manifest_counts["records_read"],
        records_kept=len(result.samples),
        dropped=result.manifest_counts["dropped"],
        truncated=result.manifest_counts["truncated"],
        total_tokens=sum(lengths),
        assistant_tokens=sum(sum(s.loss_mask) for s in result.samples),
        length_percentiles=percentiles(lengths),
        sources=sources,
        max_seq_len=max_seq_len,
        prepared_dir=str(prepared_dir),
        token_freq_path=str(token_freq_path),
    )
