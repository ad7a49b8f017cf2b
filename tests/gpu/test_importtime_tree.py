"""bench/gpu/importtime_tree.py: the import tree read back from `python3 -X importtime`, its heaviest chain and packages."""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import REPO

SPEC = importlib.util.spec_from_file_location("importtime_tree", REPO / "bench" / "gpu" / "importtime_tree.py")
importtime_tree = importlib.util.module_from_spec(SPEC)
sys.modules["importtime_tree"] = importtime_tree  # dataclasses resolve their module's annotations through sys.modules
SPEC.loader.exec_module(importtime_tree)

# CPython's format: a module's line comes after its children's, indented two spaces per level
TEXT = """\
import time: self [us] | cumulative | imported package
import time:       300 |        300 |   _io
import time:       400 |        700 | _frozen_importlib_external
import time:    200000 |     200000 |         sympy.core
import time:    100000 |     300000 |       sympy
import time:   1000000 |    1300000 |     torch._C
import time:    500000 |    1800000 |   torch
import time:     50000 |      50000 |     torch._dynamo.utils
import time:     10000 |      60000 |   torch._dynamo
import time:      1000 |    1861000 | vllm
import time:      5000 |       5000 | tabulate
"""


def test_the_tree_is_read_back_with_children_under_their_parents():
    roots = importtime_tree.parse(TEXT)
    assert [m.name for m in roots] == ["_frozen_importlib_external", "vllm", "tabulate"]
    vllm = roots[1]
    assert [c.name for c in vllm.children] == ["torch", "torch._dynamo"]
    torch = vllm.children[0]
    assert [c.name for c in torch.children] == ["torch._C"]
    assert [c.name for c in torch.children[0].children] == ["sympy"]
    assert [c.name for c in torch.children[0].children[0].children] == ["sympy.core"]


def test_the_heaviest_chain_follows_the_largest_cumulative_time_and_names_the_siblings():
    chain = importtime_tree.heaviest_chain(importtime_tree.parse(TEXT), depth=3)
    assert [step["module"] for step in chain] == ["vllm", "torch", "torch._C"]
    assert chain[0]["cumulative_s"] == 1.861
    assert chain[0]["next_heaviest"] == {"tabulate": 0.005, "_frozen_importlib_external": 0.001}
    assert chain[1]["next_heaviest"] == {"torch._dynamo": 0.06}


def test_self_time_is_summed_by_top_level_package():
    report = importtime_tree.breakdown(TEXT, depth=2, top=3)
    assert report["by_package"] == {"torch": 1.56, "sympy": 0.3, "tabulate": 0.005}
    assert report["total_s"] == round((700 + 1861000 + 5000) / 1e6, 3)
    assert report["modules"] == 10


def test_text_without_importtime_lines_or_with_odd_indentation_is_refused():
    with pytest.raises(ValueError, match="no `import time:` lines"):
        importtime_tree.parse("Traceback (most recent call last):\nModuleNotFoundError: No module named 'vllm'\n")
    with pytest.raises(ValueError, match="odd indentation"):
        importtime_tree.parse("import time:       300 |        300 |  _io\n")


def test_the_command_reads_gzipped_output_and_writes_its_report(tmp_path):
    source = tmp_path / "importtime.txt.gz"
    source.write_bytes(gzip.compress(TEXT.encode()))
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "importtime_tree.py"), str(source), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())[str(source)]
    assert report["heaviest_chain"][0]["module"] == "vllm"
