"""Where a fresh import's seconds go, read from `python3 -X importtime` output: the heaviest chain and each package.

    python3 -X importtime -c "import vllm" 2> importtime.txt
    python3 bench/gpu/importtime_tree.py importtime.txt [--depth 4] [--top 12] [--out importtime_tree.json]

Why (issue #42): on the 8B-shape lease of 2026-12-06 `import vllm` took 10.3-14.9 s in each evaluation process,
and installed bytecode does not shorten it (bench/gpu/results/2026-12-07-import-time/). CPython prints one line per
module as its import finishes, children before their parent, indented two spaces per level of nesting:
`import time: <self us> | <cumulative us> | <indent><module>`. This reads that tree back and reports:
- `roots`: the top-level imports by cumulative time (what the `-c` statement paid for);
- `heaviest_chain`: from the heaviest root, the heaviest child at each level, with each of its siblings' cumulative
  time, down to `--depth` levels: which import pulls the cost in;
- `by_package`: self time summed by top-level package (`torch._dynamo.x` counts to `torch`), the largest `--top`.
The input may be gzipped (`.gz`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)\s*$")


@dataclass
class Module:
    name: str
    self_us: int
    cumulative_us: int
    children: list[Module] = field(default_factory=list)


def parse(text: str) -> list[Module]:
    """The import tree: roots in import order, each with its children (CPython prints children first)."""
    pending: dict[int, list[Module]] = {}
    roots: list[Module] = []
    for line in text.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        self_us, cumulative_us, indent, name = int(match[1]), int(match[2]), len(match[3]), match[4]
        if indent % 2:
            raise ValueError(f"odd indentation ({indent} spaces) in -X importtime line: {line!r}")
        level = indent // 2
        module = Module(name, self_us, cumulative_us, pending.pop(level + 1, []))
        (roots if level == 0 else pending.setdefault(level, [])).append(module)
    if not roots:
        raise ValueError("no `import time:` lines: run `python3 -X importtime -c 'import <module>' 2> FILE`")
    return roots


def heaviest_chain(roots: list[Module], depth: int) -> list[dict[str, object]]:
    """From the heaviest root, the heaviest child at each level, with its siblings' cumulative seconds."""
    chain, level = [], roots
    for _ in range(depth):
        if not level:
            break
        ranked = sorted(level, key=lambda m: -m.cumulative_us)
        chain.append({
            "module": ranked[0].name,
            "cumulative_s": round(ranked[0].cumulative_us / 1e6, 3),
            "self_s": round(ranked[0].self_us / 1e6, 3),
            "next_heaviest": {m.name: round(m.cumulative_us / 1e6, 3) for m in ranked[1:4]},
        })  # fmt: skip
        level = ranked[0].children
    return chain


def by_package(roots: list[Module]) -> Counter[str]:
    """Self microseconds summed by top-level package over the whole tree."""
    totals: Counter[str] = Counter()
    stack = list(roots)
    while stack:
        module = stack.pop()
        totals[module.name.split(".")[0]] += module.self_us
        stack.extend(module.children)
    return totals


def breakdown(text: str, depth: int = 4, top: int = 12) -> dict[str, object]:
    """The report this script writes: total, roots, heaviest chain and the largest packages by self time."""
    roots = parse(text)
    packages = by_package(roots)
    total_us = sum(m.cumulative_us for m in roots)
    return {
        "total_s": round(total_us / 1e6, 3),
        "modules": sum(1 for line in text.splitlines() if LINE.match(line)),
        "roots": {m.name: round(m.cumulative_us / 1e6, 3) for m in sorted(roots, key=lambda m: -m.cumulative_us)[:top]},
        "heaviest_chain": heaviest_chain(roots, depth),
        "by_package": {name: round(us / 1e6, 3) for name, us in packages.most_common(top)},
    }


def read(path: Path) -> str:
    return gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("importtime", type=Path, nargs="+", help="-X importtime output (stderr), .gz accepted")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = {str(path): breakdown(read(path), args.depth, args.top) for path in args.importtime}
    text = json.dumps(report, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
