"""What `make setup` byte-compiles (envs/compile_working_set.py, issue #45): the modules the workflow's processes
imported, and the files in the same folders, not the rest of site-packages, never a package's own test suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def working_set_module():
    spec = importlib.util.spec_from_file_location("compile_working_set", ROOT / "envs" / "compile_working_set.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, text: str = "VALUE = 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def compiled(path: Path) -> bool:
    return Path(importlib.util.cache_from_source(str(path))).exists()


def test_setup_compiles_what_was_imported_and_the_files_beside_it_not_the_rest(tmp_path):
    cws = working_set_module()
    site = tmp_path / "site-packages"
    imported = write(site / "pkg" / "a.py")
    init = write(site / "pkg" / "__init__.py")
    sibling = write(site / "pkg" / "b.py")
    below = write(site / "pkg" / "sub" / "c.py")
    suite = write(site / "pkg" / "tests" / "test_a.py")
    suite_beside = write(site / "pkg" / "tests" / "conftest.py")
    other = write(site / "other" / "x.py")
    outside = write(tmp_path / "repo" / "stage.py")
    modules = [
        SimpleNamespace(__file__=str(imported)),
        SimpleNamespace(__file__=str(init)),
        SimpleNamespace(__file__=str(suite)),  # imported once (a test that ran), still not compiled with its folder
        SimpleNamespace(__file__=str(outside)),  # the repository's own code: not site-packages
        SimpleNamespace(__name__="builtin"),  # no file
        SimpleNamespace(__file__=str(site / "ext.cpython-311-x86_64-linux-gnu.so")),
    ]
    loaded = cws.loaded_files(modules, site.resolve())
    assert loaded == {imported.resolve(), init.resolve(), suite.resolve()}

    count = cws.compile_beside(loaded, site.resolve())

    assert count == 3, f"{count}: pkg/__init__.py, a.py and b.py"
    assert all(compiled(p) for p in (imported, init, sibling))
    assert not any(compiled(p) for p in (below, suite, suite_beside, other, outside))
    assert cws.compile_beside(loaded, site.resolve()) == 0, "a second setup compiles nothing again"


def test_a_file_beside_that_does_not_compile_is_left_for_its_import_to_report(tmp_path):
    cws = working_set_module()
    site = tmp_path / "site-packages"
    imported = write(site / "pkg" / "a.py")
    python2 = write(site / "pkg" / "example_py2.py", 'print "hello"\n')

    cws.compile_beside({imported.resolve()}, site.resolve())

    assert compiled(imported) and not compiled(python2)
