"""Code-completion stubs cut from Python source (eagle3_workflow.regenerate.stubs) and read back as a prompt file."""

from __future__ import annotations

import gzip
import json

import pytest

from eagle3_workflow.regenerate import stubs
from eagle3_workflow.regenerate.prompts import read_prompt_file
from eagle3_workflow.settings.errors import StageError

MODULE = '''
import os

def scale(values: list[float], factor: float = 2.0) -> list[float]:
    """Multiply every value by the factor.

    >>> scale([1.0, 2.0])
    [2.0, 4.0]
    """
    return [v * factor for v in values]

def no_arguments():
    """A documented function that takes nothing: nothing to complete from."""

def _private(x):
    """A private helper with a docstring long enough to count."""

def short(x):
    """Too short."""

@staticmethod
def decorated(path, *, mode="r"):
    """Open the path in the mode and return the handle, decorators dropped."""

def outer(x):
    """The outer function, whose nested helper is not a stub of its own."""
    def inner(y):
        """A nested function with a docstring that is long enough."""

class Stack(list):
    def push(self, item):
        """Put the item on top of the stack and return the new depth."""

    def clear(self):
        """Only self: there is nothing to complete the method from here."""

class _Hidden:
    def visible(self, x):
        """A method of a private class, left out with its class."""
'''


def test_stubs_are_the_public_documented_functions_with_arguments_as_humaneval_writes_them():
    found = {stub.source: stub.text for stub in stubs.stubs_of_source(MODULE, "pkg/mod.py")}
    assert sorted(found) == ["pkg/mod.py:Stack.push", "pkg/mod.py:decorated", "pkg/mod.py:outer", "pkg/mod.py:scale"]
    assert found["pkg/mod.py:scale"] == (
        "def scale(values: list[float], factor: float=2.0) -> list[float]:\n"
        '    """Multiply every value by the factor.\n'
        "\n"
        "    >>> scale([1.0, 2.0])\n"
        "    [2.0, 4.0]\n"
        '    """\n'
    )
    assert found["pkg/mod.py:decorated"].startswith("def decorated(path, *, mode='r'):\n")
    assert found["pkg/mod.py:Stack.push"] == (
        "class Stack(list):\n"
        "    def push(self, item):\n"
        '        """Put the item on top of the stack and return the new depth.\n'
        '        """\n'
    )
    assert "return" not in found["pkg/mod.py:scale"].split('"""')[-1]  # no body


def test_a_module_that_does_not_parse_gives_no_stubs():
    assert stubs.stubs_of_source("def broken(:\n", "bad.py") == []


def test_a_docstring_that_cannot_be_quoted_as_is_is_left_out():
    module = 'def f(x):\n    r"""Match a backslash \\\\ in x, and report where it was found."""\n'
    assert stubs.stubs_of_source(module, "m.py") == []


def test_collect_walks_in_path_order_skips_tests_and_keeps_one_of_each_text(tmp_path):
    (tmp_path / "b.py").write_text(MODULE)
    (tmp_path / "a.py").write_text(MODULE)  # the same texts: kept once, from the first file walked
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "c.py").write_text(MODULE.replace("scale", "scale_in_tests"))
    (tmp_path / "test_d.py").write_text(MODULE.replace("scale", "scale_in_test_module"))
    found = stubs.collect_stubs([tmp_path])
    assert [s.source for s in found] == ["a.py:scale", "a.py:decorated", "a.py:outer", "a.py:Stack.push"]


def test_the_sample_is_seeded_and_keeps_path_order():
    pool = [stubs.Stub(f"m.py:f{i}", f"def f{i}(x):\n") for i in range(50)]
    first, again = stubs.sample(pool, 10, seed=3), stubs.sample(pool, 10, seed=3)
    assert first == again and len(first) == 10
    assert [pool.index(s) for s in first] == sorted(pool.index(s) for s in first)
    assert stubs.sample(pool, 10, seed=4) != first
    assert stubs.sample(pool, None, seed=3) == pool


@pytest.mark.parametrize("name", ["stubs.jsonl", "stubs.jsonl.gz"])
def test_the_written_file_is_a_prompt_file_the_regeneration_reads(tmp_path, name):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mod.py").write_text(MODULE)
    out = tmp_path / name
    assert stubs.main([str(tmp_path / "src"), "--out", str(out), "--max", "3"]) == 0
    prompts = read_prompt_file(out)
    assert len(prompts) == 3
    assert all(
        p.messages[0]["role"] == "user" and p.messages[-1] == {"role": "assistant", "content": ""} for p in prompts
    )
    assert prompts[0].messages[0]["content"].startswith("def ")
    if name.endswith(".gz"):
        first = out.read_bytes()
        stubs.main([str(tmp_path / "src"), "--out", str(out), "--max", "3"])
        assert out.read_bytes() == first  # the same stubs, the same bytes
        assert json.loads(gzip.decompress(first).splitlines()[0])["source"].startswith("mod.py:")


def test_an_out_name_the_regeneration_would_not_read_as_json_is_refused(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mod.py").write_text(MODULE)
    with pytest.raises(SystemExit):
        stubs.main([str(tmp_path / "src"), "--out", str(tmp_path / "stubs.txt")])
    assert "name a .jsonl or .jsonl.gz file" in capsys.readouterr().err
    assert not (tmp_path / "stubs.txt").exists()


def test_a_gzipped_prompt_file_that_is_not_gzip_fails_with_the_fix(tmp_path):
    bad = tmp_path / "prompts.jsonl.gz"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(StageError, match=r"cannot be read: .*write it again \(gzip for a \.gz name\)"):
        read_prompt_file(bad)


def test_an_unknown_prompt_file_name_names_every_accepted_suffix(tmp_path):
    odd = tmp_path / "prompts.csv.gz"
    odd.write_bytes(gzip.compress(b"x"))
    with pytest.raises(StageError, match=r"'\.csv\.gz'.*\.jsonl\.gz"):
        read_prompt_file(odd)


def test_the_shipped_stdlib_stubs_read_as_prompts():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "config" / "data" / "python311_stdlib_stubs.jsonl.gz"
    prompts = read_prompt_file(shipped)
    assert len(prompts) > 2000
    assert all(p.messages[0]["content"].rstrip().endswith('"""') for p in prompts)
