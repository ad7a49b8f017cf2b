"""bench_gpu.py --split-method: a third server between plain prefill and the extraction server, with vLLM's
extract_hidden_states method and no connector, so the 2.5% gap the 8B shape showed on two H100s (2026-12-07) splits
into the method's share and the connector's. Its spec must differ from the extraction server's in the connector
alone, or the split measures something else."""

from __future__ import annotations

import dataclasses

from conftest import REPO, load_script

from eagle3_workflow.serving.engine import hidden_states_server_spec
from eagle3_workflow.settings.stages import ExtractHiddenStatesStage
from eagle3_workflow.settings.views import view_of, with_schema_defaults

GPU = REPO / "bench" / "gpu"


def extraction_spec(tmp_path):
    stage = view_of(ExtractHiddenStatesStage, with_schema_defaults())
    return hidden_states_server_spec(
        stage, model=str(tmp_path / "target"), layer_ids=[2, 16, 29, 32], storage_dir=str(tmp_path / "files"),
        device="cuda", enable_render_endpoint=False,
    )  # fmt: skip


def test_the_method_only_server_differs_from_the_extraction_server_in_its_connector_alone(tmp_path):
    bench = load_script(GPU / "bench_gpu.py")
    full = extraction_spec(tmp_path)
    method = bench.method_only_spec(full)
    assert full.kv_transfer_config is not None and method.kv_transfer_config is None
    assert method.speculative_config == full.speculative_config
    assert method.speculative_config["method"] == "extract_hidden_states"
    differing = {
        f.name for f in dataclasses.fields(full) if getattr(full, f.name) != getattr(method, f.name)
    }  # fmt: skip
    assert differing == {"kv_transfer_config"}


def test_a_method_server_that_does_not_start_is_a_recorded_result(tmp_path, monkeypatch):
    bench = load_script(GPU / "bench_gpu.py")

    class Refused:
        def __init__(self, spec, log_path):
            self.spec = spec

        def __enter__(self):
            raise RuntimeError("vLLM refused: extract_hidden_states needs a connector")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(bench, "VLLMServer", Refused)
    args = type("Args", (), {"concurrency": 4, "repeats": 3})()
    result = bench.method_only_passes(extraction_spec(tmp_path), [[1, 2, 3]], args, tmp_path)
    assert result == {"error": repr(RuntimeError("vLLM refused: extract_hidden_states needs a connector"))}
