"""One reader per thing on disk: the target's config.json (target_config), its safetensors weight map
(target_weights), the prepared dataset (prepared) and a hidden-state file (hidden_states). Each stage reads these
through them only."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import save_file

from eagle3_workflow.files.hidden_states import HiddenStateFiles, hs_file, read_hidden_states, read_sample
from eagle3_workflow.files.prepared import open_prepared, read_input_ids
from eagle3_workflow.files.target_weights import NotSafetensors, weight_files
from eagle3_workflow.reference.target_config import read_target_config, read_tensors
from eagle3_workflow.settings.errors import StageError

PACKAGE = REPO / "workflow" / "scripts" / "eagle3_workflow"


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_target_config_reads_a_plain_decoder(tmp_path):
    target = write_config(tmp_path / "t", {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                           "num_hidden_layers": 32, "hidden_size": 4096, "vocab_size": 128256,
                                           "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5})  # fmt: skip
    config = read_target_config(target)
    assert (config.architecture, config.model_type, config.decoder_model_type) == ("LlamaForCausalLM", "llama", "llama")
    assert (config.num_layers, config.hidden_size, config.vocab_size, config.dtype) == (32, 4096, 128256, "bfloat16")
    assert not config.tie_word_embeddings
    assert config.text["rms_norm_eps"] == 1e-5
    info = config.info()
    assert (info.path, info.num_layers, info.hidden_size, info.vocab_size) == (str(target), 32, 4096, 128256)


def test_target_config_takes_the_language_model_of_a_multimodal_wrapper(tmp_path):
    """A wrapper keeps the decoder's shape in text_config: layers, width, dtype and model_type come from there, the
    architecture and the checkpoint's own model_type from the top level (what check_api records)."""
    target = write_config(tmp_path / "mm", {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 34, "hidden_size": 2560, "vocab_size": 262208},
    })  # fmt: skip
    config = read_target_config(target)
    assert (config.model_type, config.decoder_model_type) == ("gemma3", "gemma3_text")
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (34, 2560, 262208)
    assert config.dtype is None, "transformers' text config has no dtype of its own here: evaluation falls back"
    assert config.tie_word_embeddings


def test_target_config_dtype_is_the_one_transformers_reads(tmp_path):
    from transformers import AutoConfig

    for key, value in (("torch_dtype", "float16"), ("dtype", "float32"), (None, None)):
        target = write_config(tmp_path / f"d-{key}", {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
                              | ({key: value} if key else {}))  # fmt: skip
        text = AutoConfig.from_pretrained(target).get_text_config()
        found = getattr(text, "dtype", None)
        assert read_target_config(target).dtype == (None if found is None else str(found).removeprefix("torch."))


def test_target_config_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(StageError, match="config.json does not exist: target.path must be a HF model directory"):
        read_target_config(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(StageError, match=r"cannot be read as JSON \(JSONDecodeError"):
        read_target_config(tmp_path / "broken")
    config = read_target_config(write_config(tmp_path / "no-width", {"model_type": "x", "num_hidden_layers": 2}))
    assert config.num_layers == 2, "a key is required only where it is used"
    with pytest.raises(StageError, match="has no 'hidden_size' \\(looked in the top level\\)"):
        config.hidden_size  # noqa: B018


def test_weight_files_of_a_single_file_and_a_sharded_checkpoint(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(single / "model.safetensors"))
    assert weight_files(single) == {"a": "model.safetensors", "b": "model.safetensors"}
    assert read_tensors(single, weight_files(single), ["b"])["b"].tolist() == [0.0, 0.0, 0.0]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.ones(2)}, str(sharded / "one.safetensors"))
    save_file({"b": torch.zeros(3)}, str(sharded / "two.safetensors"))
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(read_tensors(sharded, weight_files(sharded), ["a", "b"])) == {"a", "b"}
    with pytest.raises(NotSafetensors, match="neither model.safetensors nor model.safetensors.index.json"):
        weight_files(tmp_path)


def test_prepared_dataset_reads_as_plain_rows(prepared, tmp_path):
    dataset = open_prepared(prepared["prepared"])
    assert isinstance(dataset[0]["input_ids"], list), "plain Python rows, not the trainer's torch format"
    ids = read_input_ids(prepared["prepared"])
    assert len(ids) == len(dataset) and ids[0] == dataset[0]["input_ids"]
    with pytest.raises(StageError, match="does not exist; run prepare_data first"):
        open_prepared(tmp_path / "missing")


def test_hidden_state_reads_and_the_folder_of_one_shape(tmp_path):
    hidden = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4).to(torch.bfloat16)
    save_file({"hidden_states": hidden, "token_ids": torch.tensor([5, 6, 7])}, str(hs_file(tmp_path, 4)))
    states, token_ids = read_sample(tmp_path, 4)
    assert torch.equal(states, hidden) and token_ids.tolist() == [5, 6, 7]
    assert torch.equal(read_hidden_states(tmp_path, 4), hidden)
    assert torch.equal(read_hidden_states(tmp_path, 4, slice(None, 2)), hidden[:2])
    assert torch.equal(read_hidden_states(tmp_path, 4, slice(-1, None))[0, -1], hidden[-1, -1])
    files = HiddenStateFiles(tmp_path, layer_count=2, hidden_size=4)
    assert files.path(4) == hs_file(tmp_path, 4)
    assert files.check(files.path(4), [5, 6, 7], full=True) is None
    assert "shape" in files.check(files.path(4), [5, 6], full=False)
    assert files.estimate_bytes([3]) > 3 * 2 * 4 * 2


def _reads(node: ast.AST, needle: str) -> bool:
    """Whether one AST node reads `needle`'s thing: a call of the reader, a key looked up, a path or a name built."""
    if needle == "load_from_disk":
        return isinstance(node, ast.Attribute) and node.attr == "load_from_disk"
    if needle == "text_config":  # config.get("text_config"), config["text_config"]
        keys = node.args if isinstance(node, ast.Call) else [node.slice] if isinstance(node, ast.Subscript) else []
        return any(isinstance(key, ast.Constant) and key.value == "text_config" for key in keys)
    if needle == "model.safetensors.index.json":  # target_dir / "model.safetensors.index.json"
        return isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant) and node.right.value == needle
    if needle == "hs_<row>.safetensors":  # f"hs_{row}.safetensors"
        return isinstance(node, ast.JoinedStr) and any(
            isinstance(v, ast.Constant) and str(v.value).endswith("hs_") for v in node.values
        )
    if needle == "a hidden-state file opened":  # safe_open(str(hs_file(...))), load_file(hs_file(...))
        return (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", "")) in ("safe_open", "load_file")
            and "hs_file(" in ast.unparse(node)
        )
    raise AssertionError(needle)


# each thing on disk and the one module that reads it
OWN_READER = {
    "load_from_disk": "files/prepared.py",
    "text_config": "reference/target_config.py",
    "model.safetensors.index.json": "files/target_weights.py",
    "hs_<row>.safetensors": "files/hidden_states.py",
    "a hidden-state file opened": "files/hidden_states.py",
}


@pytest.mark.parametrize("needle", sorted(OWN_READER))
def test_each_thing_on_disk_has_one_reader(needle):
    """The package reads the prepared dataset, the target's config and weight map, and hidden-state files only through
    their reader (prose in docstrings and messages aside): a second reader elsewhere fails here, naming its module."""
    found = {
        path.relative_to(PACKAGE).as_posix()
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if _reads(node, needle)
    }
    assert found <= {OWN_READER[needle]}, f"{needle} is read outside {OWN_READER[needle]}: {sorted(found)}"
