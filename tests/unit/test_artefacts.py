"""files.artefacts.load and files.artefacts.write: a good file round-trips; a missing key, a wrong type, a file that is not JSON
(or is absent) fails with one message naming the file, each bad field and the rule to rerun; keys a newer writer
added are ignored. Every stage reads its inputs through load, so these are the failures a person sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic_run import acceptance_report

from eagle3_workflow.files.artefacts import ArtefactError, CheckRow, load, write
from eagle3_workflow.files.data_artefacts import GreedyCheck, ValidationReport
from eagle3_workflow.files.draft_artefacts import AcceptanceReport
from eagle3_workflow.files.target_artefacts import ApiCompatReport, TargetInfo
from eagle3_workflow.settings.errors import StageError


def validation_report() -> ValidationReport:
    return ValidationReport(
        passed=True, samples_expected=4, samples_valid=4, missing=[], bad={}, tokens=120, bytes=4096, layer_count=4,
        hidden_size=64, files_dir=["/runs/t/hidden_states/files"],
        greedy_check=[GreedyCheck(row=0, server_token=7, recomputed_token=7, logit_gap=0.0, tolerance=0.25, ok=True)],
    )  # fmt: skip


def api_compat_report() -> ApiCompatReport:
    return ApiCompatReport(
        passed=True, vllm_version="0.32.0", speculators_version="0.9.0", transformers_version="5.19.0",
        torch_version="2.13.0", device="cpu", layer_ids=[2, 4, 5, 8],
        checks=[CheckRow(name="vllm version", expected=">=0.18.0,<0.34.0", found="0.32.0", passed=True)],
        target=TargetInfo(path="/t", architecture="LlamaForCausalLM", model_type="llama", num_layers=8,
                          hidden_size=64, vocab_size=512),
    )  # fmt: skip


def written(tmp_path: Path, data: object, name: str = "validation.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def refusal(model: type, path: Path) -> str:
    with pytest.raises(ArtefactError) as refused:
        load(model, path)
    assert isinstance(refused.value, StageError)  # run_stage logs it as a gate failure: message, no traceback
    return str(refused.value)


def test_a_written_artefact_loads_back_equal_with_its_keys_in_field_order(tmp_path):
    write(tmp_path / "validation.json", validation_report())
    on_disk = json.loads((tmp_path / "validation.json").read_text())
    assert list(on_disk) == list(ValidationReport.model_fields)
    assert on_disk["greedy_check"] == [
        {"row": 0, "server_token": 7, "recomputed_token": 7, "logit_gap": 0.0, "tolerance": 0.25, "ok": True}
    ]
    assert load(ValidationReport, tmp_path / "validation.json") == validation_report()
    write(tmp_path / "acceptance.json", acceptance_report(mismatches=1))
    again = load(AcceptanceReport, tmp_path / "acceptance.json")
    assert again == acceptance_report(mismatches=1)
    assert again.trained.mismatches[0].expected_token == 17
    assert again.processes[0].engine_start_s["trained"] == 2.5


def test_a_validation_report_without_passed_is_refused(tmp_path):
    """train_draft read `validation.get("passed") is False`: a file without the key let training start."""
    data = validation_report().model_dump()
    del data["passed"]
    message = refusal(ValidationReport, written(tmp_path, data))
    assert f"{tmp_path / 'validation.json'} is not a valid ValidationReport" in message
    assert "  passed: missing" in message
    assert "Rerun the rule that writes it: snakemake --forcerun validate_hidden_states" in message


def test_train_draft_refuses_a_validation_report_without_passed(tmp_path):
    from conftest import train_settings

    from eagle3_workflow.trainer.command import TrainDevice
    from eagle3_workflow.training.stage import train_draft

    write(tmp_path / "api_compat.json", api_compat_report())
    data = validation_report().model_dump()
    del data["passed"]
    settings = train_settings({})
    with pytest.raises(ArtefactError, match="passed: missing"):
        train_draft(
            settings, target=tmp_path / "target", prepared=tmp_path / "prepared", token_freq=tmp_path / "f.pt",
            api_compat=tmp_path / "api_compat.json", validation=written(tmp_path, data), files_dir=tmp_path / "files",
            work_dir=tmp_path / "work", out_dir=tmp_path / "draft", trust_remote_code=False,
            device=TrainDevice("cpu", 1),
        )  # fmt: skip
    assert not (tmp_path / "work").exists()  # refused before anything was prepared


def test_a_wrong_type_names_the_field_and_what_was_found(tmp_path):
    data = validation_report().model_dump() | {"layer_count": "four", "missing": {"0": 1}}
    message = refusal(ValidationReport, written(tmp_path, data))
    assert "  layer_count: Input should be a valid integer, unable to parse string as an integer (found 'four')" in (
        message
    )
    assert "  missing: Input should be a valid list (found {'0': 1})" in message


def test_a_nested_field_is_named_by_its_path(tmp_path):
    data = acceptance_report(mismatches=1).model_dump()
    del data["trained"]["mismatches"][0]["found_text"]
    data["untrained"]["per_position_acceptance"][1] = "high"
    message = refusal(AcceptanceReport, written(tmp_path, data, "acceptance.json"))
    assert "  trained.mismatches.0.found_text: missing" in message
    assert "  untrained.per_position_acceptance.1: Input should be a valid number" in message
    assert "snakemake --forcerun evaluate_draft" in message


def test_many_bad_fields_are_listed_short(tmp_path):
    message = refusal(ValidationReport, written(tmp_path, {"greedy_check": []}))
    lines = message.splitlines()
    assert sum(line.endswith(": missing") for line in lines) == 8
    assert "  ... and 2 more" in lines  # 10 missing
    assert len(lines) == 11  # the file, 8 fields, the rest counted, the fix


def test_a_file_that_is_not_json_or_not_an_object_or_absent_is_refused(tmp_path):
    write(tmp_path / "api_compat.json", api_compat_report())
    text = (tmp_path / "api_compat.json").read_text()
    (tmp_path / "api_compat.json").write_text(text[: len(text) // 2])  # a writer killed mid-file (not ours)
    message = refusal(ApiCompatReport, tmp_path / "api_compat.json")
    assert "api_compat.json is not JSON (JSONDecodeError(" in message
    assert "snakemake --forcerun check_api" in message
    message = refusal(ApiCompatReport, written(tmp_path, [1, 2], "api_compat.json"))
    assert "  (the whole file): Input should be a valid dictionary or instance of ApiCompatReport" in message
    message = refusal(ApiCompatReport, tmp_path / "absent.json")
    assert (
        f"cannot read {tmp_path / 'absent.json'} (FileNotFoundError(" in message and "--forcerun check_api" in message
    )


def test_keys_a_newer_writer_added_are_ignored(tmp_path):
    data = api_compat_report().model_dump()
    data["added_by_a_newer_writer"] = {"x": 1}
    data["checks"][0]["severity"] = "info"
    assert load(ApiCompatReport, written(tmp_path, data, "api_compat.json")) == api_compat_report()


def test_the_writer_replaces_a_file_whole(tmp_path):
    path = tmp_path / "checks" / "api_compat.json"
    write(path, api_compat_report())
    write(path, api_compat_report().model_copy(update={"passed": False}))
    assert load(ApiCompatReport, path).passed is False
    assert [p.name for p in path.parent.iterdir()] == ["api_compat.json"]  # no temporary file left beside it
    assert path.read_text().endswith("}\n")


def test_a_draft_config_without_its_model_type_is_refused_by_evaluation(tmp_path):
    from eagle3_workflow.evaluation.stage import check_eagle3_draft

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"]}))
    with pytest.raises(ArtefactError, match=r"(?s)config.json is not a valid DraftConfig.*speculators_model_type"):
        check_eagle3_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "independent"}))
    with pytest.raises(StageError, match="speculators_model_type 'independent'; this stage evaluates EAGLE-3"):
        check_eagle3_draft(tmp_path)
