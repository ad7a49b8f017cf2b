"""What the CPU environment `make setup` builds does to every interpreter it starts: the cyclic garbage collector's
thresholds, and gc.freeze() at exit (envs/setup_cpu.sh writes both into a .pth file; bench/suite/bench_gc_imports.py
measures why)."""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str) -> str:
    """`code` in a fresh interpreter of this environment, as every stage, server and Snakemake job starts."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_every_interpreter_of_the_environment_collects_garbage_less_often():
    thresholds = tuple(int(v) for v in run_python("import gc; print(*gc.get_threshold())").split())
    # Python's default is (700, 10, 10)
    assert thresholds[0] >= 10_000, f"{thresholds}: envs/setup_cpu.sh's .pth did not run (make setup)"


def test_garbage_in_reference_cycles_is_still_collected_without_being_asked():
    """Cycles are freed by the collector on its own (no gc.collect()) while the process runs: the thresholds make
    it run less often, never not at all."""
    code = """
import gc
import weakref

freed = [0]
class Node:
    pass
def count(_):
    freed[0] += 1
for _ in range(3 * gc.get_threshold()[0]):
    node = Node()
    node.self = node
    weakref.finalize(node, count, None)
del node
print(freed[0])
"""
    assert int(run_python(code)) > 0


def test_at_exit_the_collector_skips_what_lived_as_long_as_the_process_after_every_other_handler(tmp_path):
    """The .pth registers gc.freeze with atexit before anything else can, so it runs last: a handler registered
    later (a library's, the workflow's) and weakref.finalize callbacks still find the collector as it was. What a
    process left open is still written: an unclosed file's buffer reaches the disk."""
    unclosed = tmp_path / "unclosed.txt"
    code = f"""
import atexit
import gc
import weakref

class Resource:
    pass
kept = Resource()
weakref.finalize(kept, lambda: print("finalize sees", gc.get_freeze_count(), "frozen"))
atexit.register(lambda: print("a later handler sees", gc.get_freeze_count(), "frozen"))
left_open = open({str(unclosed)!r}, "w")
left_open.write("buffered, never flushed")
atexit._run_exitfuncs()  # what the interpreter's exit runs first; the finalization follows
print("after every handler:", gc.get_freeze_count() > 0)
"""
    assert run_python(code).splitlines() == [
        "a later handler sees 0 frozen",
        "finalize sees 0 frozen",
        "after every handler: True",
    ], "envs/setup_cpu.sh's .pth registers gc.freeze first, so that it runs last (make setup)"
    assert unclosed.read_text() == "buffered, never flushed"


def test_the_environment_runs_on_the_distributions_python_where_there_is_one():
    """envs/setup_cpu.sh builds the venv on /usr/bin/python3.11 where it exists (a PGO build, statically linked:
    0.85x the CPU time of vLLM's imports against pyenv's default build, bench/suite/bench_interpreters.py), unless
    PYTHON names another; elsewhere on the first Python 3.11 it finds."""
    import os
    from pathlib import Path

    base = os.path.realpath(sys._base_executable)
    assert sys.version_info[:2] == (3, 11), sys.version
    if Path("/usr/bin/python3.11").exists() and not os.environ.get("PYTHON"):
        assert base == os.path.realpath("/usr/bin/python3.11"), f"{base}: not the distribution's Python (make setup)"
