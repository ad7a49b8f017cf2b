"""Resuming evaluate_draft: what an earlier attempt measured that this one may reuse.

Each engine's run gets a key (keyed_run): a hash of everything that decides its result (the engine's kwargs, the
run, the spec's fields with the prompts by digest, the kernels, the bytes of the models it loads by
fingerprint.model_fingerprint, vLLM's switches and the test fault plugins in the environment). Its result goes to
work_dir/runs/<label>.<role>.json, the key's parts beside it (.key.json); an attempt reuses a result whose key
holds (reusable_result) and logs which part changed where it does not (explain_changed_key). The untrained draft
is kept across attempts while its recipe holds (baseline), so the keys of its engines hold too: rebuilt, its
1.77 GiB of weights at the 8B shape (fingerprinted by size:mtime) changed both untrained engines' keys and each
resume measured them again (H100, 2026-12-06). The judgement after the engines keeps nothing and runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from eagle3_workflow.evaluation.fingerprint import model_fingerprint
from eagle3_workflow.evaluation.protocol import MeasurementRun, RunResult
from eagle3_workflow.files.artefacts import load

log = logging.getLogger("eagle3.evaluation")


def run_role(run: MeasurementRun) -> str:
    """What a run's engine does: lossless, timing or both (its result file is <label>.<role>.json)."""
    return "lossless" if not run.timing_pass else "timing" if not run.lossless_pass else "both"


def keyed_run(
    run: MeasurementRun,
    engine: dict[str, Any],
    spec_fields: dict[str, Any],
    *,
    batch_invariant: bool,
    work_dir: Path,
    fingerprints: dict[Path, dict[str, str]] | None = None,
) -> MeasurementRun:
    """The run with its key (a hash of the engine, the passes, the prompts and the bytes of the models it loads)
    and the file its result goes to. `fingerprints` keeps each model folder's fingerprint for the next call (the
    folders must not change meanwhile)."""
    role = run_role(run)
    fingerprints = {} if fingerprints is None else fingerprints
    models = [engine["model"]] + ([run.speculative_config["model"]] if run.speculative_config else [])
    content = {
        "engine": engine,
        "run": run.model_dump(mode="json", exclude={"key", "result_path"}),
        # the prompts by digest: the key's parts are kept beside the result, and 164 prompts are ~250 KB
        "spec": spec_fields | {"prompts": hashlib.sha256(json.dumps(spec_fields.get("prompts")).encode()).hexdigest()},
        "batch_invariant": batch_invariant,
        "models": {m: known_fingerprint(Path(m), fingerprints) for m in models if Path(m).is_dir()},
        # vLLM's switches and the test fault plugins change results without changing a setting
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "EAGLE3_FAULT"))},
    }
    text = json.dumps(content, sort_keys=True, default=str, indent=1)
    key = hashlib.sha256(text.encode()).hexdigest()
    result_path = work_dir.resolve() / "runs" / f"{run.label}.{role}.json"
    explain_changed_key(result_path.with_suffix(".key.json"), json.loads(text))
    return run.model_copy(update={"key": key, "result_path": str(result_path)})


def explain_changed_key(path: Path, content: dict[str, Any]) -> None:
    """Keep what the key was made of beside the result; when it changed since the last attempt, log which part
    did (the engine is measured again)."""
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = {}
        changed = sorted(k for k in content.keys() | earlier.keys() if content.get(k) != earlier.get(k))
        if changed:
            log.info("%s: measured again, what decides its result changed since the last attempt: %s",
                     path.name.removesuffix(".key.json"), ", ".join(changed))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, sort_keys=True, indent=1))


def known_fingerprint(folder: Path, known: dict[Path, dict[str, str]]) -> dict[str, str]:
    if folder not in known:
        known[folder] = model_fingerprint(folder)
    return known[folder]


def reusable_result(run: MeasurementRun) -> RunResult | None:
    """The result an earlier attempt left for this run, if it was measured with the same key."""
    from eagle3_workflow.files.artefacts import ArtefactError

    path = Path(run.result_path or "")
    if not path.is_file():
        return None
    try:
        earlier = load(RunResult, path)
    except ArtefactError as exc:
        log.info("not reusing %s: %r", path, exc)
        return None
    return earlier if earlier.key == run.key else None
