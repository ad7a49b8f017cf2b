"""Stage `package_draft`: the trained draft as something a user can publish as is (a model card beside it).

results/<run>/published_draft/ = the files of draft/ (hard links where the file system allows, else copies) plus a
README.md generated from the run's artefacts: target, data and its size, training settings, acceptance trained vs
untrained, the `vllm serve` command that uses the draft, provenance. It runs after evaluate_draft because the card
quotes the measured acceptance; draft/ itself stays untouched (evaluate_draft and a rerun read it).

render_model_card() is pure (the stage's settings and artefact models in, Markdown out); package_draft() is the thin file adapter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.data_artefacts import DataManifest, RegenerationStats
from eagle3_workflow.files.draft_artefacts import AcceptanceReport, Provenance, TrainingSummary
from eagle3_workflow.files.target_artefacts import BUILD_RECORD, ApiCompatReport, SmolLM2Build, TargetInfo
from eagle3_workflow.files.writing import published_directory
from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.settings.stages import PackageDraftStage

CARD_NAME = "README.md"


@dataclasses.dataclass
class CardInputs:
    """Everything the card says: the stage's settings and the run's artefacts."""

    settings: PackageDraftStage  # the run's name and the sections target, regenerate, train, evaluate, vllm
    target: TargetInfo  # checks/api_compat.json "target"
    manifest: DataManifest  # data/manifest.json
    training: TrainingSummary  # draft/training.json
    acceptance: AcceptanceReport  # eval/acceptance.json
    provenance: Provenance  # provenance.json
    draft_files: dict[str, str]  # file name -> sha256, of the published files (the card excluded)
    regenerated: RegenerationStats | None = None  # data/regenerated.stats.json when the data was self-distilled
    built_from: dict[str, Any] | None = None  # <target>/eagle3_build.json "source", for a target the workflow built


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def serve_command(target_path: str, draft_ref: str, num_speculative_tokens: int) -> str:
    """The vLLM command that serves the target with this draft (the speculative config evaluate_draft used)."""
    spec = json.dumps({"method": "eagle3", "model": draft_ref, "num_speculative_tokens": num_speculative_tokens})
    return f"vllm serve {target_path} \\\n  --speculative-config '{spec}'"


def _target_section(inputs: CardInputs) -> list[str]:
    target, cfg = inputs.target, inputs.settings.target
    build = cfg.build
    origin = cfg.path or (f"built by the workflow (target.build.kind: {build.kind})" if build else "n/a")
    return [
        "## Target",
        "",
        f"- model: `{target.path}` ({origin})",
        *([f"- built from: {inputs.built_from}"] if inputs.built_from else []),
        f"- architecture: {target.architecture}, {_fmt(target.num_layers)} layers, hidden "
        f"{_fmt(target.hidden_size)}, vocabulary {_fmt(target.vocab_size)}, "
        f"dtype {cfg.dtype}",
        f"- hidden states captured at vLLM layer ids {inputs.training.target_layer_ids}",
        "",
    ]


def _data_section(inputs: CardInputs) -> list[str]:
    manifest, regen = inputs.manifest, inputs.regenerated
    lines = [
        "## Training data",
        "",
        f"- conversations: {_fmt(manifest.records_kept)} kept of {_fmt(manifest.records_read)} read "
        f"(dropped: {manifest.dropped or 'none'}; truncated: {_fmt(manifest.truncated)})",
        f"- tokens: {_fmt(manifest.total_tokens)} in all, {_fmt(manifest.assistant_tokens)} of "
        f"them assistant tokens (trained on); max sequence length {_fmt(manifest.max_seq_len)}",
        f"- sources: {', '.join(f'`{s}`' for s in manifest.sources) or 'n/a'}",
    ]
    settings = inputs.settings.regenerate
    if regen is not None or settings.enabled:
        lines.append(
            "- self-distilled: the target answered the prompts itself (greedy at temperature "
            f"{settings.temperature}, up to {settings.max_tokens} tokens), prompt files "
            f"{list(settings.prompt_files)} plus {settings.magpie_prompts} Magpie user turns asked of "
            "the target"
            + "".join(
                f", {s.prompts} more steered by the system prompt {s.system_prompt!r} (`magpie[{s.name}]`; "
                "the answers under the default template)"
                for s in settings.magpie_steered
            )
        )
        if regen is not None:
            shown = {k: v for k, v in regen.model_dump().items() if not isinstance(v, (list, dict))}
            lines.append(f"- regeneration record: {shown}")
    return [*lines, ""]


def _training_section(inputs: CardInputs) -> list[str]:
    training, train_cfg = inputs.training, inputs.settings.train
    return [
        "## Training",
        "",
        "| setting | value |",
        "|---|---|",
        f"| trainer | speculators {_fmt(inputs.provenance.packages.get('speculators'))} (its `cli.main`), "
        f"{training.device}, {_fmt(training.processes)} process(es) |",
        f"| draft | EAGLE-3, {train_cfg.draft_layers} decoder layer(s), {train_cfg.ttt_steps} TTT steps |",
        f"| draft vocabulary | {_fmt(training.draft_vocab_size)} tokens |",
        f"| hidden states | {training.hidden_states_source()} |",
        f"| optimizer, lr | {train_cfg.optimizer}, {train_cfg.lr} |",
        f"| epochs, steps | {_fmt(training.epochs)}, {_fmt(training.steps)} |",
        f"| packed sequence length | {_fmt(train_cfg.total_seq_len)} |",
        f"| final loss train / validation | {_fmt(training.final_train_loss)} / {_fmt(training.final_val_loss)} |",
        f"| final validation accuracy per position | {training.final_val_full_acc} |",
        f"| extra trainer arguments | {list(train_cfg.extra_args) or 'none'} |",
        "",
    ]


def _acceptance_section(inputs: CardInputs) -> list[str]:
    acc = inputs.acceptance
    levels = [t.concurrency for t in acc.no_speculation_throughput]
    rows = []
    for result in (acc.trained, acc.untrained):
        per_position = " / ".join(f"{p:.3f}" for p in result.per_position_acceptance)
        speeds = " | ".join(f"{_fmt(t.tokens_per_s, 1)} (x{_fmt(t.speedup, 2)})" for t in result.throughput)
        speeds = speeds or " | ".join(["not timed"] * len(levels))  # evaluate.time_untrained false
        counted = result.acceptance_prompts  # None: every prompt; the untrained CPU reference: its first few
        label = result.label if counted is None else f"{result.label} (first {len(counted)} prompts)"
        rows.append(
            f"| {label} | **{_fmt(result.mean_acceptance_length)}** | {per_position or 'n/a'} | "
            f"{_fmt(result.num_drafts)} | {speeds} |"
        )
    plain = " | ".join(f"{_fmt(t.tokens_per_s, 1)} (x1.00)" for t in acc.no_speculation_throughput)
    rows.append(f"| no speculation | - | - | - | {plain} |")
    speed_headers = " | ".join(f"tokens/s at concurrency {c} (speedup)" for c in levels)
    trained, untrained = acc.trained.mean_acceptance_length, acc.untrained.mean_acceptance_length
    ratio = f"{trained / untrained:.2f}x the untrained draft" if trained and untrained else "n/a"
    lossless = "yes" if acc.lossless else "NO"
    return [
        "## Acceptance",
        "",
        f"{_fmt(acc.num_prompts)} prompts ({acc.prompt_source}: {acc.prompt_detail}), "
        f"greedy, k = {acc.num_speculative_tokens} speculative tokens, up to {_fmt(acc.max_tokens)} new tokens, vLLM "
        f"{acc.vllm_version} on {acc.device}. Mean acceptance length = tokens per "
        f"verification step including the bonus token (1 + accepted / drafts): trained {ratio}.",
        "",
        f"| draft | mean acceptance length | acceptance per position | drafts | {speed_headers} |",
        "|---|---|---|---|" + "---|" * len(levels),
        *rows,
        "",
        f"Lossless: {lossless}, {acc.lossless_criterion} ({acc.lossless_numerics} kernels; "
        f"{_fmt(acc.lossless_mismatches)} first divergences). Tokens/s: production settings, the first "
        f"prompts at each concurrency. "
        f"The untrained draft: {acc.untrained_baseline}.",
        *[f"Note: {note}" for note in acc.notes],
        "",
    ]


def _provenance_section(inputs: CardInputs) -> list[str]:
    prov = inputs.provenance
    dirty = " (uncommitted changes)" if prov.git_dirty else ""
    # the files that ran, by git tree id: `git log --format='%H %T' | grep <id>` finds the commit holding them
    tree = f", files: git tree `{prov.git_tree}`" if prov.git_tree else ""
    files = [f"| `{name}` | `{digest}` |" for name, digest in sorted(inputs.draft_files.items())]
    return [
        "## Provenance",
        "",
        f"- workflow commit `{prov.git_commit}`{dirty}{tree}, "
        f"run `{inputs.settings.run}`, host {prov.host}, accelerators {prov.accelerators or 'none'}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in sorted(prov.packages.items())) or 'n/a'}",
        f"- training command: `{' '.join(inputs.training.command) or 'n/a'}`",
        "",
        "| file | sha256 |",
        "|---|---|",
        *files,
        "",
    ]


def render_model_card(inputs: CardInputs) -> str:
    """The README.md of the published draft (Markdown), from the run's artefacts only."""
    acc = inputs.acceptance
    k = acc.num_speculative_tokens
    target_path = inputs.target.path or inputs.settings.target.path or "<target>"
    header = [
        f"# EAGLE-3 draft for `{Path(str(target_path)).name}` (run `{inputs.settings.run}`)",
        "",
        f"A speculative-decoding draft model (EAGLE-3, speculators format) for the target below, trained by the "
        f"gated EAGLE-3 workflow. Mean acceptance length {_fmt(acc.trained.mean_acceptance_length)} at k = {k} on "
        f"{_fmt(acc.num_prompts)} {acc.prompt_source} prompts. Generated from the run's artefacts; do not edit by "
        "hand (rerun rule `package_draft`).",
        "",
        "## Use it",
        "",
        "```bash",
        serve_command(str(target_path), "<this folder or its hub id>", k),
        "```",
        "",
        "vLLM verifies every drafted token with the target, so outputs are the target's own (greedy: identical). "
        "Replace the target path with where the same target lives for you (the same weights: a draft is trained "
        "against one target's hidden states).",
        "",
    ]
    sections = (_target_section, _data_section, _training_section, _acceptance_section, _provenance_section)
    return "\n".join(header + [line for section in sections for line in section(inputs)])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def built_from(target_dir: Path | None) -> dict[str, Any] | None:
    """What a target the workflow built was made from (its build record), or None (no record: not built here)."""
    record = Path(target_dir) / BUILD_RECORD if target_dir else None
    return load(SmolLM2Build, record).source if record is not None and record.exists() else None


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)  # no second copy of a large checkpoint where the file system allows
    except OSError:
        shutil.copy2(source, dest)


def package_draft(paths: dict[str, Path], settings: PackageDraftStage, out_dir: Path) -> Path:
    """Publish draft/ + README.md into out_dir, all or nothing. paths: draft, acceptance, manifest, api_compat,
    provenance, and optionally target (the model directory) and regenerated (the regeneration stats)."""
    draft = Path(paths["draft"])
    # no hidden files: Snakemake's .snakemake_timestamp, hard-linked, would make touching the published copy's
    # timestamp touch draft/'s too, and every later run would replan evaluate_draft
    files = sorted(p for p in draft.iterdir() if p.is_file() and p.name != CARD_NAME and not p.name.startswith("."))
    if not any(p.name == "config.json" for p in files):
        raise StageError(f"{draft} has no config.json: not a published draft; rerun train_draft")
    regenerated = paths.get("regenerated")
    inputs = CardInputs(
        settings=settings, target=load(ApiCompatReport, paths["api_compat"]).target,
        manifest=load(DataManifest, paths["manifest"]), training=load(TrainingSummary, draft / "training.json"),
        acceptance=load(AcceptanceReport, paths["acceptance"]), provenance=load(Provenance, paths["provenance"]),
        draft_files={p.name: sha256_of(p) for p in files},
        regenerated=load(RegenerationStats, regenerated) if regenerated and Path(regenerated).exists() else None,
        built_from=built_from(paths.get("target")),
    )  # fmt: skip
    with published_directory(out_dir) as staging:
        for path in files:
            _link_or_copy(path, staging / path.name)
        (staging / CARD_NAME).write_text(render_model_card(inputs))
    return out_dir
