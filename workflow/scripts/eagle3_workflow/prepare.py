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

from eagle3_workflow.chat import TemplateError, load_chat_tokenizer, normalize_messages, tokenize_conversation
from eagle3_workflow.contracts import DataManifest, write_json_atomic
from eagle3_workflow.errors import StageError, render_table

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
    with open(path, encoding="utf-8") as handle:
        head = handle.read(1)
        while head and head.isspace():
            head = handle.read(1)
        handle.seek(0)
        if head == "[":
            try:
                items = json.load(handle)
            except json.JSONDecodeError as exc:
                yield BadRecord(str(path), exc.lineno, "malformed_json", repr(exc))
                return
            for i, item in enumerate(items):
                yield RawRecord(str(path), i + 1, item)
            return
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield RawRecord(str(path), lineno, json.loads(line))
            except json.JSONDecodeError as exc:
                yield BadRecord(str(path), lineno, "malformed_json", repr(exc))


def _from_parquet_row(row: dict[str, Any]) -> dict[str, Any]:
    # parquet nested columns come back as numpy arrays of dicts
    out = {}
    for key, value in row.items():
        if hasattr(value, "tolist"):
            value = value.tolist()
        out[key] = value
    return out


def messages_of(record: RawRecord, declared_format: str) -> list[dict[str, str]]:
    payload = record.payload
    if not isinstance(payload, dict):
        raise ValueError(f"record is {type(payload).__name__}, expected an object")
    if declared_format in ("sharegpt", "auto", "parquet") and "conversations" in payload:
        return normalize_messages(payload["conversations"], role_key="from", content_key="value")
    if declared_format in ("messages", "auto", "parquet") and "messages" in payload:
        return normalize_messages(payload["messages"], role_key="role", content_key="content")
    raise ValueError(f"record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {sorted(payload)}")


@dataclasses.dataclass
class PreparedSample:
    input_ids: list[int]
    loss_mask: list[int]
    messages: list[dict[str, str]]
    source: str
    line: int


@dataclasses.dataclass
class PreparationResult:
    samples: list[PreparedSample]
    manifest_counts: dict[str, Any]
    bad_records: list[BadRecord]


def prepare_conversations(
    sources: list[tuple[Path, str]],
    tokenizer: Any,
    *,
    max_seq_len: int,
    overlength: str = "truncate",
    on_bad_record: str = "fail",
    min_assistant_tokens: int = 1,
    max_samples: int | None = None,
    seed: int = 0,
) -> PreparationResult:
    """Parse, render, mask and length-filter every record. Pure: no files are written."""
    kept: list[PreparedSample] = []
    bad: list[BadRecord] = []
    dropped: collections.Counter[str] = collections.Counter()
    records_read = 0
    truncated = 0
    for path, declared in sources:
        for item in read_records(path, declared):
            records_read += 1
            if isinstance(item, BadRecord):
                bad.append(item)
                continue
            try:
                messages = messages_of(item, declared)
            except ValueError as exc:
                reason = "no_assistant_turn" if "no assistant turn" in str(exc) else "invalid_record"
                bad.append(BadRecord(item.source, item.line, reason, str(exc)))
                continue
            try:
                tokenized = tokenize_conversation(tokenizer, messages)
            except TemplateError as exc:
                bad.append(BadRecord(item.source, item.line, "template_error", str(exc)))
                continue
            ids, mask = tokenized.input_ids, tokenized.loss_mask
            if len(ids) > max_seq_len:
                if overlength == "drop":
                    dropped["overlength"] += 1
                    continue
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                truncated += 1
            if sum(mask) < min_assistant_tokens:
                bad.append(
                    BadRecord(
                        item.source,
                        item.line,
                        "no_assistant_tokens",
                        f"{sum(mask)} assistant tokens kept (minimum {min_assistant_tokens}) of "
                        f"{len(tokenized.input_ids)} tokens; max_seq_len={max_seq_len}",
                    )
                )
                continue
            kept.append(PreparedSample(ids, mask, messages, item.source, item.line))

    if bad and on_bad_record == "fail":
        shown = bad[:MAX_REPORTED_BAD]
        table = render_table(["where", "reason", "detail"], [(b.where(), b.reason, b.detail) for b in shown])
        more = f"\n... and {len(bad) - len(shown)} more" if len(bad) > len(shown) else ""
        raise StageError(
            f"{len(bad)} bad record(s) in the input data:\n{table}{more}\n"
            "Fix the records, or set data.on_bad_record: skip to drop them (they are then counted in "
            "data/manifest.json under dropped)."
        )
    for b in bad:
        dropped[b.reason] += 1

    if not kept:
        raise StageError(
            f"no record survived preparation ({records_read} read; dropped by reason: {dict(dropped)}). "
            "Check data.sources, the record format, data.max_seq_len and the tokenizer's chat template."
        )
    rng = random.Random(seed)
    rng.shuffle(kept)  # speculators splits train/validation by position: shuffle before that
    if max_samples is not None and len(kept) > max_samples:
        dropped["max_samples"] += len(kept) - max_samples
        kept = kept[:max_samples]
    counts = {"records_read": records_read, "dropped": dict(dropped), "truncated": truncated}
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


def main(snakemake: Any) -> None:
    from eagle3_workflow.errors import run_stage

    def body(log: logging.Logger) -> None:
        cfg = snakemake.config["data"]
        tokenizer = load_chat_tokenizer(
            snakemake.input.target, trust_remote_code=snakemake.config["target"]["trust_remote_code"]
        )
        sources = [(Path(p), fmt) for p, fmt in zip(snakemake.input.sources, snakemake.params.formats, strict=True)]
        result = prepare_conversations(
            sources,
            tokenizer,
            max_seq_len=cfg["max_seq_len"],
            overlength=cfg["overlength"],
            on_bad_record=cfg["on_bad_record"],
            min_assistant_tokens=cfg["min_assistant_tokens"],
            max_samples=cfg["max_samples"],
            seed=cfg["seed"],
        )
        prepared_dir = Path(snakemake.output.prepared)
        token_freq_path = Path(snakemake.output.token_freq)
        write_prepared(result, prepared_dir, token_freq_path)
        manifest = build_manifest(
            result, [str(p) for p, _ in sources], cfg["max_seq_len"], prepared_dir, token_freq_path
        )
        for b in result.bad_records[:MAX_REPORTED_BAD]:
            log.warning("skipped %s: %s (%s)", b.where(), b.reason, b.detail)
        log.info(
            "kept %d of %d records; dropped %s; %d tokens (%d assistant)",
            manifest.records_kept,
            manifest.records_read,
            manifest.dropped,
            manifest.total_tokens,
            manifest.assistant_tokens,
        )
        write_json_atomic(snakemake.output.manifest, manifest)

    run_stage("prepare_data", snakemake.log[0], body)
