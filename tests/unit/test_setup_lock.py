"""The CPU environment's lock, envs/constraints-cpu.txt, is the only source of versions (issue #45): every line an
exact pin with the sha256 of the files it may be installed from, which envs/setup_cpu.sh hands to uv with
--no-deps --require-hashes (uv itself is one of its lines), and the environment `make setup` built holds exactly
those versions."""

import hashlib
import importlib.metadata
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "envs" / "constraints-cpu.txt"
REQUIREMENTS = ROOT / "envs" / "requirements-cpu.txt"
# what `pip freeze` leaves out of the lock, and the venv has all the same
NOT_LOCKED = {"pip", "setuptools", "wheel"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_entries(text: str) -> dict[str, tuple[str, list[str]]]:
    """{normalized name: (version, [sha256, ...])} of a requirements file in pip's hash-checking form."""
    entries = {}
    for entry in text.replace("\\\n", " ").splitlines():
        if not entry.strip() or entry.startswith("#"):
            continue
        requirement, *options = entry.split()
        name, separator, version = requirement.partition("==")
        assert separator and version, f"{requirement!r}: not an exact pin (name==version) in {LOCK}"
        hashes = [option.removeprefix("--hash=sha256:") for option in options]
        assert all(option.startswith("--hash=sha256:") for option in options), f"{entry!r}: an option not a hash"
        entries[normalized(name)] = (version, hashes)
    return entries


def test_every_line_of_the_lock_is_an_exact_pin_with_the_sha256_of_its_files():
    entries = lock_entries(LOCK.read_text())
    assert len(entries) > 200, f"{len(entries)} entries: not the full freeze of the CPU environment"
    unhashed = sorted(name for name, (_, hashes) in entries.items() if not hashes)
    assert not unhashed, (
        f"{len(unhashed)} of {len(entries)} locked without a hash ({', '.join(unhashed[:8])}, ...), which uv "
        "--require-hashes refuses; re-lock with "
        "rm envs/constraints-cpu.txt && make setup (envs/setup_cpu.sh writes the hashes)"
    )
    malformed = sorted(
        name for name, (_, hashes) in entries.items() if not all(re.fullmatch("[0-9a-f]{64}", h) for h in hashes)
    )
    assert not malformed, f"{malformed}: a hash that is not a sha256 hex digest"
    assert entries["torch"][0].endswith("+cpu"), f"torch {entries['torch'][0]}: not the CPU build"
    assert "uv" in entries, "the installer envs/setup_cpu.sh runs is not pinned by the lock"


def test_the_lock_was_made_from_the_requirements_as_they_are():
    header = LOCK.read_text().splitlines()[0]
    made_from = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    assert header == f"# requirements-cpu.txt sha256: {made_from}", (
        f"{header!r}: envs/requirements-cpu.txt changed since the lock was made (sha256 {made_from}); "
        "re-lock with rm envs/constraints-cpu.txt && make setup, then commit the new lock"
    )


def test_the_environment_holds_exactly_the_versions_of_the_lock():
    locked = {name: version for name, (version, _) in lock_entries(LOCK.read_text()).items()}
    installed = {normalized(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    differ = {
        name: (installed.get(name), version) for name, version in locked.items() if installed.get(name) != version
    }
    assert not differ, f"(installed, locked) where they differ: {differ}; make setup installs the lock"
    unlocked = sorted(set(installed) - set(locked) - NOT_LOCKED)
    assert not unlocked, f"{unlocked}: installed but not in the lock"
