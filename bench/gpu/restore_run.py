"""Carry a finished lease's regenerated data into a later lease, so that no lease repeats the regeneration.

The lent machine keeps nothing between leases, and what a call brings back is small (at most 8 files of 16 MiB):
hidden states and checkpoints never come back, the self-distilled conversations do (16 MB of JSONL, 1.8 MB as xz).
So a later lease rebuilds the target (~45 s), restores `check_target`'s and `regenerate_responses`' outputs from a
bundle committed under bench/gpu/results/, and runs from `prepare_data` on.

    # here, from a results-<run>.tar.gz that `device_run.sh collect` brought back (unpacked into DIR):
    python bench/gpu/restore_run.py pack DIR/<run> bench/gpu/results/<date>-<run>/restore --config <files...>
    # on the machine (`device_run.sh restore`, after the target is built in the run folder):
    python bench/gpu/restore_run.py unpack bench/gpu/results/<date>-<run>/restore results/<run> --config <files...>

What `unpack` proves before it writes anything, each refusal naming the fix (rerun without RESTORE, and the
regeneration runs again):
- the rebuilt target is the one that answered: every file of the target folder but the weights has the recorded
  sha256, and its build record the recorded GGUF (sha256), shape and greedy answer (the weights' own bytes never
  came back; the greedy answer is what they produce);
- the config asks for the data that was made: every setting regenerate_responses ran with (its spec's `settings`,
  recorded at pack time) equals the merged config's, but for the few that only bound time or memory
  (OPERATIONAL). Snakemake cannot check this itself: restored files carry no Snakemake metadata, so its params
  trigger does not see them; this check is that trigger;
- the prompt files are the ones the data answered: each of `regenerate.prompt_files` has the sha256 recorded at
  pack time (the config names them by path, and a file edited under the same path would otherwise pass);
- every restored file has its recorded sha256 after decompression.

Then the files are written atomically and their mtimes set after the target's (sanity first, then the data), so
Snakemake plans prepare_data and what follows, never check_target or regenerate_responses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import sys
import time
from pathlib import Path
from typing import Any

# 2 (2026-12-07): the prompt files' sha256 recorded and checked; a format-1 bundle is packed again
BUNDLE_FORMAT = 2
REPO = Path(__file__).resolve().parents[2]
RECORD = "restore.json"
# (path in the run folder, the bundle's stored name): the order is the order of their mtimes
RESTORED = (
    ("checks/target_sanity.json", "target_sanity.json"),
    ("data/regenerated.stats.json", "regenerated.stats.json"),
    ("data/regenerated.jsonl", "regenerated.jsonl.xz"),
)
REGENERATION_SPEC = "data/.regenerated.spec.json"
WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt")
BUILD_RECORD = "eagle3_build.json"
BUILD_FIELDS = ("source", "dtype", "num_layers", "hidden_size", "vocab_size", "tie_word_embeddings", "greedy")
# settings that bound time or memory only: they do not change what the target answers
OPERATIONAL = {
    ("regenerate", "runtime_minutes"),
    ("vllm", "ready_timeout_s"),
    ("vllm", "stall_timeout_s"),
    ("vllm", "cpu_threads"),
    ("vllm", "gpu_memory_utilization"),
}
SNAKEMAKE_STAMP = ".snakemake_timestamp"


class RestoreRefused(Exception):
    """The bundle does not fit this run: the message says what differs and what to do."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_sha256(path: Path) -> str:
    """A file's sha256; a JSON file's without the version of transformers that wrote it (config.json and
    generation_config.json carry it: the same build here, with transformers 5.19, and on the H200, with 5.17,
    differs in that key only)."""
    if path.suffix != ".json":
        return sha256_of(path)
    content = json.loads(path.read_text())
    if isinstance(content, dict):
        content.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def target_fingerprint(target: Path) -> dict[str, Any]:
    """What identifies a built target without its weights: every other file's content_sha256 (the build record's
    reproducible fields instead of its bytes: it also holds the build's timings)."""
    files = {}
    for path in sorted(p for p in target.iterdir() if p.is_file()):
        if path.name in (BUILD_RECORD, SNAKEMAKE_STAMP) or path.name.endswith(WEIGHTS_SUFFIXES):
            continue
        files[path.name] = content_sha256(path)
    record = target / BUILD_RECORD
    build = json.loads(record.read_text()) if record.is_file() else {}
    fields = {k: build[k] for k in BUILD_FIELDS if k in build}
    if isinstance(fields.get("source"), dict):  # the GGUF by its bytes, not by where this machine installed it
        fields["source"] = {k: v for k, v in fields["source"].items() if k != "path"}
    return {"files": files, "build": fields}


def merged_config(config_files: list[Path], repo: Path) -> dict[str, Any]:
    """The config Snakemake runs: config/config.yaml, then each file deep-merged in order, the schema's defaults."""
    import yaml
    from snakemake.utils import update_config

    sys.path.insert(0, str(repo / "workflow" / "scripts"))
    from eagle3_workflow.settings.schema import validate_config

    config = yaml.safe_load((repo / "config" / "config.yaml").read_text()) or {}
    for path in config_files:
        update_config(config, yaml.safe_load(Path(path).read_text()) or {})
    validate_config(config, repo / "workflow" / "schemas" / "config.schema.yaml")
    return config


# the section the regeneration reads whole: a key of it that a bundle does not record did not exist when the data
# was made, so the data was made as its schema default says
WHOLE_SECTION = "regenerate"


def schema_defaults(section: str, repo: Path) -> dict[str, Any]:
    """The schema's default of every key of one config section."""
    import yaml

    schema = yaml.safe_load((repo / "workflow" / "schemas" / "config.schema.yaml").read_text())
    return {key: node.get("default") for key, node in schema["properties"][section]["properties"].items()}


def settings_differences(
    recorded: dict[str, Any], config: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """Every recorded regeneration setting the config now sets otherwise (OPERATIONAL ones left out); and, given
    `defaults` (schema_defaults of WHOLE_SECTION), every key of that section the bundle predates that the config
    sets to anything but its default (e.g. regenerate.magpie_steered against data made before it existed)."""
    differences = []
    for section, values in sorted(recorded.items()):
        current = config.get(section) or {}
        expected = dict(values)
        if section == WHOLE_SECTION and defaults is not None:
            expected = {key: defaults[key] for key in current if key not in values and key in defaults} | expected
        for key, value in sorted(expected.items()):
            if (section, key) in OPERATIONAL:
                continue
            now = current.get(key, "<unset>")
            if isinstance(now, tuple):
                now = list(now)
            if now != value:
                made = f"{value!r}" if key in values else f"{value!r} (the key's default: the data predates it)"
                differences.append(f"{section}.{key}: the data was made with {made}, the config now says {now!r}")
    return differences


def prompt_file_digests(settings: dict[str, Any], stats: dict[str, Any], repo: Path) -> dict[str, str]:
    """The sha256 of each prompt file the regeneration read, as it is in `repo`; refused when a file here does not
    hold the number of prompts the regeneration read from it (its stats' `prompts_read`): then it is not that file."""
    sys.path.insert(0, str(repo / "workflow" / "scripts"))
    from eagle3_workflow.regenerate.prompts import read_prompt_file

    read = {Path(path).as_posix(): count for path, count in (stats.get("prompts_read") or {}).items()}
    digests = {}
    for name in (settings.get("regenerate") or {}).get("prompt_files") or []:
        path = repo / name
        counted = [count for read_path, count in read.items() if read_path.endswith("/" + Path(name).as_posix())]
        here = len(read_prompt_file(path))
        if counted != [here]:
            raise RestoreRefused(
                f"{path} holds {here} prompts, the regeneration read {counted or 'no file by that name'} "
                f"(its stats' prompts_read: {sorted(read)}): pack with the tree the lease ran (git checkout that "
                "commit), so that the bundle records the prompt files the data answered"
            )
        digests[name] = sha256_of(path)
    return digests


def prompt_file_differences(recorded: dict[str, str], repo: Path) -> list[str]:
    """Each recorded prompt file whose bytes in `repo` are not those the data answered."""
    differences = []
    for name, digest in sorted(recorded.items()):
        path = repo / name
        found = sha256_of(path) if path.is_file() else "no such file"
        if found != digest:
            differences.append(f"{name}: the data answered sha256 {digest}, this tree's is {found}")
    return differences


def pack(run_dir: Path, bundle: Path, config_files: list[Path], repo: Path) -> dict[str, Any]:
    """The bundle of a finished regeneration: its outputs (the data as xz), their sha256, the target's fingerprint
    and the settings the regeneration ran with."""
    spec = json.loads((run_dir / REGENERATION_SPEC).read_text())
    differences = settings_differences(
        spec["settings"], merged_config(config_files, repo), schema_defaults(WHOLE_SECTION, repo)
    )
    if differences:
        raise RestoreRefused(
            "the run's regeneration does not match these config files:\n  " + "\n  ".join(differences)
            + "\npack with the config files the lease ran (device_run.sh's CONFIG)"
        )  # fmt: skip
    stats = json.loads((run_dir / "data" / "regenerated.stats.json").read_text())
    prompt_files = prompt_file_digests(spec["settings"], stats, repo)
    bundle.mkdir(parents=True, exist_ok=True)
    files = []
    for relative, stored in RESTORED:
        source = run_dir / relative
        data = source.read_bytes()
        payload = lzma.compress(data, preset=9) if stored.endswith(".xz") else data
        (bundle / stored).write_bytes(payload)
        files.append(
            {"path": relative, "stored": stored, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )
    record = {
        "format": BUNDLE_FORMAT,
        "run": run_dir.name,
        "config_files": [str(p) for p in config_files],
        "target": target_fingerprint(run_dir / "target"),
        "regeneration_settings": spec["settings"],
        "prompt_files": prompt_files,
        "files": files,
    }
    (bundle / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def check_bundle(bundle: Path, run_dir: Path, config: dict[str, Any], repo: Path = REPO) -> dict[str, Any]:
    """The refusals of `unpack`, before anything is written; the bundle's record when it fits."""
    record = json.loads((bundle / RECORD).read_text())
    if record.get("format") != BUNDLE_FORMAT:
        raise RestoreRefused(
            f"{bundle / RECORD} has format {record.get('format')!r}, this script reads {BUNDLE_FORMAT} (format 2 "
            "records the prompt files' sha256): pack it again from that lease's results (restore_run.py pack), or "
            "run without RESTORE"
        )
    target = run_dir / "target"
    if not target.is_dir():
        raise RestoreRefused(
            f"{target} does not exist: build the target first (device_run.sh restore runs the build rule), then unpack"
        )
    found, expected = target_fingerprint(target), record["target"]
    if found != expected:
        changed = sorted(k for k in set(found["files"]) | set(expected["files"])
                         if found["files"].get(k) != expected["files"].get(k))  # fmt: skip
        changed += [f"{BUILD_RECORD}:{k}" for k in BUILD_FIELDS
                    if found["build"].get(k) != expected["build"].get(k)]  # fmt: skip
        raise RestoreRefused(
            f"the target in {target} is not the one that made this data (differs: {', '.join(changed)}): its answers "
            "would not be this data. Run without RESTORE: check_target and regenerate_responses then run again"
        )
    differences = settings_differences(record["regeneration_settings"], config, schema_defaults(WHOLE_SECTION, repo))
    if differences:
        raise RestoreRefused(
            "the config asks for other data than the bundle holds:\n  " + "\n  ".join(differences)
            + "\nRun without RESTORE (the regeneration runs again with these settings), or restore with the config "
            "files the bundle names: " + " ".join(record.get("config_files", []))
        )  # fmt: skip
    changed = prompt_file_differences(record["prompt_files"], repo)
    if changed:
        raise RestoreRefused(
            "a prompt file is not the one the bundle's data answered:\n  " + "\n  ".join(changed)
            + "\nRun without RESTORE (the regeneration answers the files as they are now)"
        )  # fmt: skip
    return record


def unpack(bundle: Path, run_dir: Path, config: dict[str, Any], repo: Path = REPO) -> list[Path]:
    """Check, then write the restored outputs into run_dir, newer than the target and in dependency order."""
    record = check_bundle(bundle, run_dir, config, repo)
    contents = []
    for entry in record["files"]:
        payload = (bundle / entry["stored"]).read_bytes()
        data = lzma.decompress(payload) if entry["stored"].endswith(".xz") else payload
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry["sha256"]:
            raise RestoreRefused(
                f"{bundle / entry['stored']} decompresses to sha256 {digest}, recorded {entry['sha256']}"
            )
        contents.append((run_dir / entry["path"], data))
    if all(path.is_file() and sha256_of(path) == hashlib.sha256(data).hexdigest() for path, data in contents):
        return []  # restored before in this lease: touching them again would replan prepare_data and what follows
    newest_input = max(p.stat().st_mtime for p in (run_dir / "target").iterdir())
    stamp = max(time.time(), newest_input + 1)
    written = []
    for i, (path, data) in enumerate(contents):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.restoring")
        partial.write_bytes(data)
        os.replace(partial, path)
        os.utime(path, (stamp + i, stamp + i))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["pack", "unpack"])
    parser.add_argument("source", type=Path, help="pack: the run folder; unpack: the bundle folder")
    parser.add_argument("dest", type=Path, help="pack: the bundle folder; unpack: the run folder")
    parser.add_argument("--config", nargs="+", type=Path, required=True, help="the config files, in CONFIG's order")
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args(argv)
    try:
        if args.action == "pack":
            record = pack(args.source, args.dest, args.config, args.repo)
            print(json.dumps({f["path"]: f["sha256"] for f in record["files"]}, indent=1))
        else:
            config = merged_config(args.config, args.repo)
            written = unpack(args.source, args.dest, config, args.repo)
            for path in written:
                print(f"restored {path} ({path.stat().st_size} bytes, sha256 verified)")
            if not written:
                print(f"{args.dest} already holds the bundle's files (sha256 verified): nothing written")
    except RestoreRefused as refused:
        print(f"restore refused: {refused}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
