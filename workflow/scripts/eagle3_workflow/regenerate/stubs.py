"""Code-completion prompts from Python source: each documented top-level function (or method, under its class line)
as a stub, its signature and docstring without the body, the shape of HumanEval's prompts, for the target to
complete in `regenerate_responses`.

    python -m eagle3_workflow.regenerate.stubs DIR... --out config/data/<name>.jsonl[.gz] [--max N] [--seed 0]

Why: a draft serves best on the kind of text it was trained on. Magpie turns steered to Python are mostly
questions about code, often not Python at all (issue 43); a user whose traffic is code completion can instead
self-distill on stubs cut from a source tree they may use (the standard library, their own packages). HumanEval
itself is never a source: it stays evaluation only.

Pure: `stubs_of_source` turns one module's text into stubs; `collect_stubs` walks folders; `main` writes the
prompt file (JSON lines of OpenAI `messages`, with a `source` key naming the file and function).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import gzip
import inspect
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3_workflow.regenerate.prompts import json_kind

# a docstring this short says too little to complete from; a longer one is mostly reference text, not a task
MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 800
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
# folders whose functions are tests, GUI or grammar tables rather than code a user asks to complete
SKIPPED_PARTS = frozenset(
    {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "ensurepip"}
)


@dataclasses.dataclass(frozen=True)
class Stub:
    """One function's prompt: `text` is its `def ...:` line (under its `class` line for a method) and docstring,
    indented as in HumanEval."""

    source: str  # <file relative to the walked folder>:<function name>
    text: str


def _docstring_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The function's docstring, dedented, when it makes a prompt: long enough, short enough and quotable as is."""
    doc = ast.get_docstring(node, clean=False)
    if doc is None:
        return None
    doc = inspect.cleandoc(doc)
    if not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS or '"""' in doc or "\\" in doc or doc.endswith('"'):
        return None
    return doc


def _header_of(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """The `def ...:` or `class ...:` line as ast.unparse writes it: one line, no decorators, no body."""
    bare = copy.copy(node)
    bare.body, bare.decorator_list = [ast.Pass()], []
    return ast.unparse(bare).split("\n", 1)[0]


def _function_stub(node: ast.FunctionDef | ast.AsyncFunctionDef, indent: str, first_argument: int) -> str | None:
    """A public, documented function taking an argument (past `self`/`cls` for a method) as its stub lines."""
    doc = _docstring_of(node)
    arguments = node.args.posonlyargs + node.args.args
    if node.name.startswith("_") or doc is None or not (arguments[first_argument:] or node.args.kwonlyargs):
        return None
    inner = indent + "    "
    body = "\n".join(f"{inner}{line}" if line else "" for line in doc.splitlines())
    return f'{indent}{_header_of(node)}\n{inner}"""{body.lstrip()}\n{inner}"""\n'


def stubs_of_source(text: str, where: str) -> list[Stub]:
    """Every public, documented top-level function that takes an argument, and every such method of a public
    top-level class (under its `class` line), as a stub; a module that does not parse (another Python's syntax)
    gives none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    stubs = []
    for node in tree.body:
        if isinstance(node, FUNCTIONS) and (stub := _function_stub(node, "", 0)):
            stubs.append(Stub(f"{where}:{node.name}", stub))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            header = _header_of(node)
            for method in node.body:
                if isinstance(method, FUNCTIONS) and (stub := _function_stub(method, "    ", 1)):
                    stubs.append(Stub(f"{where}:{node.name}.{method.name}", f"{header}\n{stub}"))
    return stubs


def collect_stubs(folders: Sequence[Path]) -> list[Stub]:
    """The stubs of every .py file under the folders (SKIPPED_PARTS left out), in path order, one per text."""
    seen: set[str] = set()
    stubs = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            relative = path.relative_to(folder)
            if SKIPPED_PARTS.intersection(relative.parts) or any(p.startswith("test_") for p in relative.parts):
                continue
            for stub in stubs_of_source(path.read_text(encoding="utf-8", errors="replace"), relative.as_posix()):
                if stub.text not in seen:
                    seen.add(stub.text)
                    stubs.append(stub)
    return stubs


def sample(stubs: list[Stub], limit: int | None, seed: int) -> list[Stub]:
    """At most `limit` stubs, drawn with `seed`, kept in path order (the same folders and seed: the same file)."""
    if limit is None or len(stubs) <= limit:
        return list(stubs)
    chosen = set(random.Random(seed).sample(range(len(stubs)), limit))
    return [stub for i, stub in enumerate(stubs) if i in chosen]


def records(stubs: Iterable[Stub]) -> list[dict[str, object]]:
    """Prompt-file records: one user message each (HumanEval's prompt, as the evaluation sends it)."""
    return [{"messages": [{"role": "user", "content": s.text}], "source": s.source} for s in stubs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="source trees to cut stubs from")
    parser.add_argument(
        "--out", type=Path, required=True, help="the prompt file to write (.jsonl, or .jsonl.gz gzipped)"
    )
    parser.add_argument("--max", type=int, default=None, help="at most this many stubs (a seeded sample)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    if json_kind(args.out) is None:  # a .txt would be read back as one prompt per line
        parser.error(
            f"--out {args.out}: name a .jsonl or .jsonl.gz file (regenerate.prompt_files reads it by its name)"
        )
    found = collect_stubs(args.folders)
    chosen = sample(found, args.max, args.seed)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records(chosen)).encode("utf-8")
    # mtime 0 in the gzip header: the same stubs give the same bytes, so writing the shipped file again changes nothing
    args.out.write_bytes(gzip.compress(text, 9, mtime=0) if args.out.suffix == ".gz" else text)
    print(f"{len(chosen)} stubs of {len(found)} found written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
