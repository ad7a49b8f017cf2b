"""bench/gpu/restore_run.py: an earlier lease's regenerated data into a later lease (docs/gpu.md, "2. The SmolLM2-135M preset": later leases restore).

On CPU, with the tiny preset and regeneration switched on: the bundle round-trips byte for byte; a rebuilt target
with another tokenizer, a config that asks for other data, or a corrupted bundle are refused before anything is
written; and after a real target build, the real workflow's dry run starts at prepare_data once the bundle is
unpacked (and plans the regeneration without it).
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, load_script, run_workflow

from eagle3_workflow.regenerate.prompts import read_prompt_file

SCRIPT = REPO / "bench" / "gpu" / "restore_run.py"
TINY = REPO / "config" / "presets" / "tiny.yaml"


@pytest.fixture(scope="module")
def restore():
    return load_script(SCRIPT)


def overlay(folder: Path, **regenerate) -> Path:
    path = folder / f"regenerate-{len(list(folder.glob('regenerate-*')))}.yaml"
    values = {"enabled": True, "prompt_files": ["config/data/smollm2_prompts.txt"], "magpie_prompts": 8} | regenerate
    # check_target on, as in the GPU preset (the tiny preset leaves it off): its output is restored too
    path.write_text(yaml.safe_dump({"regenerate": values, "target_check": {"enabled": True}}))
    return path


def fake_target(target: Path) -> None:
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"model_type": "llama"}')
    (target / "tokenizer.json").write_text('{"model": "bpe"}')
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "eagle3_build.json").write_text(json.dumps({"source": {"path": "/here/x.gguf", "sha256": "ab"},
                                                          "greedy": {"answer": "Paris"}, "convert_s": 1.0}))  # fmt: skip


def finished_regeneration(restore, run_dir: Path, config: dict) -> None:
    """What check_target and regenerate_responses leave in a run folder, the spec's settings as the config's."""
    (run_dir / "checks").mkdir(parents=True, exist_ok=True)
    (run_dir / "data").mkdir(parents=True, exist_ok=True)
    (run_dir / "checks" / "target_sanity.json").write_text('{"passed": true}')
    (run_dir / "data" / "regenerated.jsonl").write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n' * 50)
    # as the device writes it: each prompt file by its path there, with the number of prompts read from it
    read = {f"/root/work/{name}": len(read_prompt_file(REPO / name)) for name in config["regenerate"]["prompt_files"]}
    (run_dir / "data" / "regenerated.stats.json").write_text(
        json.dumps({"conversations_written": 50, "prompts_read": read})
    )
    settings = {"regenerate": config["regenerate"], "target": {"dtype": config["target"]["dtype"]},
                "vllm": {"max_model_len": config["vllm"]["max_model_len"], "ready_timeout_s": 1}}  # fmt: skip
    (run_dir / restore.REGENERATION_SPEC).write_text(json.dumps({"settings": settings}))


def restored_files(run_dir: Path) -> dict[str, bytes]:
    return {relative: (run_dir / relative).read_bytes() for relative, _ in
            (("checks/target_sanity.json", 0), ("data/regenerated.jsonl", 0), ("data/regenerated.stats.json", 0))}  # fmt: skip


def packed_lease(restore, tmp_path: Path) -> tuple[dict, Path, dict]:
    """A first lease's finished regeneration (tiny preset, regeneration on), packed into tmp_path/bundle: the merged
    config, the lease's run folder and the bundle's record."""
    files = [TINY, overlay(tmp_path)]
    config = restore.merged_config(files, REPO)
    run_dir = tmp_path / "lease1" / "tiny"
    fake_target(run_dir / "target")
    finished_regeneration(restore, run_dir, config)
    return config, run_dir, restore.pack(run_dir, tmp_path / "bundle", files, REPO)


def test_a_bundle_round_trips_and_lands_newer_than_the_target_in_dependency_order(restore, tmp_path):
    config, run_dir, record = packed_lease(restore, tmp_path)
    made = restored_files(run_dir)
    assert (tmp_path / "bundle" / "regenerated.jsonl.xz").stat().st_size < len(made["data/regenerated.jsonl"])
    assert record["target"]["build"]["source"] == {"sha256": "ab"}  # where the GGUF was installed is not identity

    later = tmp_path / "lease2" / "tiny"
    fake_target(later / "target")
    (later / "target" / "model.safetensors").write_bytes(b"rebuilt weights")  # the weights never come back
    written = restore.unpack(tmp_path / "bundle", later, config)
    assert restored_files(later) == made
    newest_target = max(p.stat().st_mtime for p in (later / "target").iterdir())
    mtimes = [p.stat().st_mtime for p in written]
    assert min(mtimes) > newest_target and mtimes == sorted(mtimes)
    assert [p.relative_to(later).as_posix() for p in written][0] == "checks/target_sanity.json"
    assert restore.unpack(tmp_path / "bundle", later, config) == []  # a second restore leaves the mtimes alone
    assert [p.stat().st_mtime for p in written] == mtimes


def test_another_target_other_settings_or_a_corrupted_bundle_are_refused_before_anything_is_written(restore, tmp_path):
    config, run_dir, _ = packed_lease(restore, tmp_path)

    other_tokenizer = tmp_path / "other" / "tiny"
    fake_target(other_tokenizer / "target")
    (other_tokenizer / "target" / "tokenizer.json").write_text('{"model": "unigram"}')
    with pytest.raises(restore.RestoreRefused, match=r"not the one that made this data \(differs: tokenizer.json\)"):
        restore.unpack(tmp_path / "bundle", other_tokenizer, config)
    assert not (other_tokenizer / "data").exists()

    more_prompts = restore.merged_config([TINY, overlay(tmp_path, magpie_prompts=16)], REPO)
    with pytest.raises(restore.RestoreRefused, match=r"regenerate.magpie_prompts: the data was made with 8, the "
                                                     r"config now says 16"):  # fmt: skip
        restore.unpack(tmp_path / "bundle", run_dir, more_prompts)
    longer_wait = restore.merged_config([TINY, overlay(tmp_path, runtime_minutes=99)], REPO)
    assert restore.check_bundle(tmp_path / "bundle", run_dir, longer_wait)  # a time bound is not the data

    (tmp_path / "bundle" / "regenerated.jsonl.xz").write_bytes(lzma.compress(b"other data\n"))
    fresh = tmp_path / "fresh" / "tiny"
    fake_target(fresh / "target")
    with pytest.raises(restore.RestoreRefused, match="decompresses to sha256"):
        restore.unpack(tmp_path / "bundle", fresh, config)
    assert not (fresh / "checks").exists()  # checked before the first file is written


def test_a_bundle_that_predates_a_regenerate_key_holds_data_made_as_its_default(restore, tmp_path):
    # a bundle packed before regenerate.magpie_steered existed records no such key: its data was made without
    # steered sets, which a config asking for one must not get
    config, run_dir, record = packed_lease(restore, tmp_path)
    del record["regeneration_settings"]["regenerate"]["magpie_steered"]
    (tmp_path / "bundle" / restore.RECORD).write_text(json.dumps(record))
    assert restore.check_bundle(tmp_path / "bundle", run_dir, config)  # the default ([]): the data fits
    steer = {"name": "python", "prompts": 4, "system_prompt": "Python."}
    steered = restore.merged_config([TINY, overlay(tmp_path, magpie_steered=[steer])], REPO)
    with pytest.raises(restore.RestoreRefused, match=r"regenerate.magpie_steered: the data was made with \[\] \(the "
                                                     r"key's default: the data predates it\)"):  # fmt: skip
        restore.unpack(tmp_path / "bundle", run_dir, steered)


def test_a_prompt_file_changed_under_the_same_path_is_refused_and_pack_refuses_a_tree_that_is_not_the_leases(
    restore, tmp_path
):
    config, run_dir, record = packed_lease(restore, tmp_path)
    name = "config/data/smollm2_prompts.txt"
    assert record["prompt_files"] == {name: restore.sha256_of(REPO / name)}
    # a tree whose prompt file was edited after the data was made: the config still names the same path
    edited = tmp_path / "edited-repo"
    shutil.copytree(REPO / "workflow" / "schemas", edited / "workflow" / "schemas")
    (edited / name).parent.mkdir(parents=True)
    (edited / name).write_text((REPO / name).read_text() + "One prompt the data never answered?\n")
    with pytest.raises(restore.RestoreRefused, match=r"not the one the bundle's data answered:\n  "
                                                     r"config/data/smollm2_prompts.txt: the data answered sha256"):  # fmt: skip
        restore.check_bundle(tmp_path / "bundle", run_dir, config, edited)
    (edited / name).unlink()
    with pytest.raises(restore.RestoreRefused, match="this tree's is no such file"):
        restore.check_bundle(tmp_path / "bundle", run_dir, config, edited)

    # packing with that edited tree: its file holds one prompt more than the regeneration read
    (edited / name).write_text((REPO / name).read_text() + "One prompt the data never answered?\n")
    with pytest.raises(restore.RestoreRefused, match=r"holds \d+ prompts, the regeneration read \[\d+\]"):
        restore.prompt_file_digests(record["regeneration_settings"],
                                    json.loads((run_dir / "data" / "regenerated.stats.json").read_text()), edited)  # fmt: skip

    record["format"] = 1
    (tmp_path / "bundle" / restore.RECORD).write_text(json.dumps(record))
    with pytest.raises(restore.RestoreRefused, match="pack it again from that lease's results"):
        restore.check_bundle(tmp_path / "bundle", run_dir, config)


def planned_rules(dry_run: str) -> set[str]:
    """The rules of the dry run's job-stats table (its reasons may name files of other rules)."""
    lines = dry_run.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["job", "count"])
    rules = set()
    for line in lines[start + 2 :]:
        if line.startswith("total"):
            return rules
        rules.add(line.split()[0])
    return rules


def test_after_a_real_build_the_workflow_plans_from_prepare_data_once_the_bundle_is_unpacked(restore, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    files = [TINY, overlay(tmp_path)]
    run_workflow(work, files, targets=["results/tiny/target"], timeout=600)
    config = restore.merged_config(files, REPO)
    run_dir = work / "results" / "tiny"
    before = planned_rules(run_workflow(work, files, extra=["-n", "--quiet", "rules"]).stdout)
    assert {"regenerate_responses", "check_target"} <= before and "build_tiny_target" not in before

    lease1 = tmp_path / "lease1" / "tiny"
    shutil.copytree(run_dir / "target", lease1 / "target")
    finished_regeneration(restore, lease1, config)
    restore.pack(lease1, tmp_path / "bundle", files, REPO)
    restore.unpack(tmp_path / "bundle", run_dir, config)
    after = planned_rules(run_workflow(work, files, extra=["-n", "--quiet", "rules"]).stdout)
    assert "prepare_data" in after
    assert not after & {"regenerate_responses", "check_target", "build_tiny_target"}, after
