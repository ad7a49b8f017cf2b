"""The published Kimi-K2.5 preset (config/presets/kimi-k2.5-int4.yaml) through check_api on CPU, on the INT4 stand-in
at the real depth (61 layers, so the preset's ids [2, 30, 58, 61] = [2, N//2, N-3, N] hold on it): every row passes,
the full-depth and canary reference rows name the compressed-tensors scheme they read. Only target.path and the data
change, as a user's paths file changes them. The layout itself: tests/unit/test_kimi_layout.py; the stand-in through
every gate at TP 2: tests/e2e/test_kimi.py.
"""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, TINY_DATA, run_workflow

from eagle3_workflow.files.artefacts import load
from eagle3_workflow.files.target_artefacts import ApiCompatReport

PRESET = REPO / "config" / "presets" / "kimi-k2.5-int4.yaml"


@pytest.mark.slow
def test_published_kimi_preset_passes_check_api_on_the_int4_stand_in(kimi_stand_ins, tmp_path):
    target = kimi_stand_ins("int4", num_layers=61)
    paths = tmp_path / "my-paths.yaml"
    paths.write_text(yaml.safe_dump({"target": {"path": str(target)},
                                     "data": {"sources": [{"path": str(TINY_DATA), "format": "sharegpt"}]}}))  # fmt: skip
    preset = yaml.safe_load(PRESET.read_text())
    proc = run_workflow(tmp_path, [PRESET, paths], targets=[f"results/{preset['run']}/checks/api_compat.json"],
                        cores=2, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = load(ApiCompatReport, tmp_path / "results" / preset["run"] / "checks" / "api_compat.json")
    assert report.passed
    rows = {row.name: row for row in report.checks}
    assert rows["target architecture"].found.startswith("KimiK25ForConditionalGeneration: supports_eagle3=True")
    assert rows["layer ids"].found.startswith("[2, 30, 58, 61] of 61 layers"), rows["layer ids"].found
    for name in ("full-depth reference", "canary reference"):
        found = rows[name].found
        assert "the text model, tensors under 'language_model.'" in found, found
        assert "61 layers" in found, found
        assert "compressed-tensors pack-quantized int4 symmetric group 32" in found, found
