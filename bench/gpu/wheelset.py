"""Helpers of fetch_wheels.sh that are easier to get right (and to test) in Python than in bash.

  python3 bench/gpu/wheelset.py duplicates FILE...      exit 6 and name them when two files are one distribution
  python3 bench/gpu/wheelset.py sdist-wheel SDIST OUTDIR  build a pure-Python wheel from an sdist, byte-reproducibly

Why a wheel builder of our own: `pip wheel` on an sdist runs the machine's setuptools, whose version is written into
the wheel (WHEEL's Generator, METADATA's Metadata-Version) and whose zip timestamps and compression follow the
machine, so the built wheel's sha256 differs between machines and a pinned hash cannot hold (connection-pool 0.0.3
exists only as an sdist). This builder reads only the sdist: same sdist bytes -> same wheel bytes (stored, not
deflated: zlib builds differ; entries sorted; fixed timestamp and modes). It handles pure-Python sdists whose
modules sit at the sdist's top level (no compiled code, no setup.py logic); anything else is refused.
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import tarfile
import zipfile
from collections import defaultdict
from pathlib import Path, PurePosixPath

FIXED_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold
WHEEL_TEXT = (
    "Wheel-Version: 1.0\nGenerator: eagle3-workflow bench/gpu/wheelset.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
)


def distribution_key(filename: str) -> str:
    """The normalised project name of a wheel or sdist file name (PEP 503: runs of -_. are one -, lower case)."""
    base = filename.split(".part-")[0]
    name = base.split("-")[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def duplicate_distributions(filenames: list[str]) -> dict[str, list[str]]:
    """Distributions with more than one file in the set (two versions, or two platform tags of one version).

    One pip install of two wheels of one distribution fails (or silently keeps whichever unpacked last), so the
    carried set must hold exactly one file per distribution.
    """
    seen: dict[str, list[str]] = defaultdict(list)
    for filename in filenames:
        if filename.endswith(".whl"):
            seen[distribution_key(filename)].append(filename)
    return {key: sorted(files) for key, files in seen.items() if len(files) > 1}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _sdist_members(sdist: Path) -> tuple[str, dict[str, bytes], bytes]:
    """(top folder, {path inside the top folder: bytes} of the importable files, PKG-INFO bytes)."""
    with tarfile.open(sdist) as archive:
        files = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    top = PurePosixPath(next(iter(files))).parts[0]
    pkg_info = files.get(f"{top}/PKG-INFO")
    if pkg_info is None:
        raise SystemExit(f"{sdist}: no {top}/PKG-INFO; not an sdist this builder can read")
    if any(name.endswith((".c", ".pyx", ".cpp", ".rs")) for name in files):
        raise SystemExit(f"{sdist}: has compiled sources; build it where it runs instead")
    modules = {}
    for name, data in files.items():
        inner = PurePosixPath(*PurePosixPath(name).parts[1:])
        if inner.suffix == ".py" and inner.name != "setup.py" and not str(inner).startswith(("tests/", "test/")):
            if ".egg-info" not in str(inner):
                modules[str(inner)] = data
    if not modules:
        raise SystemExit(f"{sdist}: no Python modules at its top level (a src/ layout?); not handled")
    return top, modules, pkg_info


def build_wheel_from_sdist(sdist: Path, out_dir: Path) -> Path:
    """Write <name>-<version>-py3-none-any.whl into out_dir; same sdist bytes give the same wheel bytes."""
    top, modules, pkg_info = _sdist_members(sdist)
    name, version = top.rsplit("-", 1)
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"
    dist_info = f"{stem}.dist-info"
    entries = dict(sorted(modules.items()))
    entries[f"{dist_info}/METADATA"] = pkg_info
    entries[f"{dist_info}/WHEEL"] = WHEEL_TEXT.encode()
    top_level = sorted({PurePosixPath(p).parts[0].removesuffix(".py") for p in modules})
    entries[f"{dist_info}/top_level.txt"] = ("\n".join(top_level) + "\n").encode()
    record = [_record_line(n, d) for n, d in entries.items()] + [f"{dist_info}/RECORD,,"]
    entries[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        for entry_name, data in entries.items():
            info = zipfile.ZipInfo(entry_name, date_time=FIXED_DATE)
            info.external_attr = 0o644 << 16
            info.create_system = 3  # unix, whatever machine builds it
            archive.writestr(info, data)
    return wheel


def main(argv: list[str]) -> int:
    if argv[:1] == ["duplicates"]:
        duplicates = duplicate_distributions([Path(a).name for a in argv[1:]])
        for key, files in sorted(duplicates.items()):
            print(f"two or more files of {key}: {' '.join(files)}", file=sys.stderr)
        return 6 if duplicates else 0
    if argv[:1] == ["sdist-wheel"] and len(argv) == 3:
        print(build_wheel_from_sdist(Path(argv[1]), Path(argv[2])).name)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
