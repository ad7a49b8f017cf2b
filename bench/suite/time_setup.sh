#!/usr/bin/env bash
# `make setup` as a newcomer's first command meets it (issue #45): a fresh clone of COMMIT in /tmp, every package
# cache empty, twice in a row (the second must be the no-op), e.g.
#
#   bench/suite/time_setup.sh                 # HEAD on the machine as it is
#   bench/suite/time_setup.sh HEAD 2          # on the simulated slow day (bench/suite/slow_day.sh 2: half of each core)
#
# Empty caches: pip's and uv's (PIP_CACHE_DIR, UV_CACHE_DIR) and XDG_CACHE_HOME (vLLM's model-info cache is made by
# setup), all in a new folder; this machine's local package mirrors (pip.conf's file:// indexes and find-links
# folders) are dropped from the page cache first, so that their wheels are read from disk as on a fresh machine.
# Prints the wall time, the CPU time and the load before and after (a neighbour's load slows the setup as much as
# a slow day does: say it beside the figure). Removes the clone and the caches at the end.
set -euo pipefail
commit=${1:-HEAD}
factor=${2:-}
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/time-setup-XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$commit"
mkdir -p "$work/cache"
export PIP_CACHE_DIR=$work/cache/pip UV_CACHE_DIR=$work/cache/uv XDG_CACHE_HOME=$work/cache/xdg
# the mirrors pip is configured with (file:// indexes, local folders), out of the page cache: posix_fadvise
# DONTNEED on their files only
python3 - <<'PYEOF'
import os
import re
import subprocess

listed = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
folders = {re.sub("^file://", "", url).rstrip("/") for url in re.findall(r"(?:file://)?/[^\s']+", listed)}
folders = {f.removesuffix("/simple") for f in folders if os.path.isdir(f)}
evicted = 0
for folder in sorted(folders):
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            evicted += 1
print(f"time_setup: {evicted} files of {sorted(folders)} dropped from the page cache")
PYEOF
# ext4 looks past the inodes deleted in the last 30 s when it makes a file (recently_deleted): a setup started
# right after removing an earlier one's 100,000 files pays for that; a fresh machine does not
sleep 35
echo "time_setup: $(git -C "$work/clone" rev-parse --short HEAD) load before: $(cut -d' ' -f1-3 /proc/loadavg)"
run=(make setup)
[ -z "$factor" ] || run=("$repo/bench/suite/slow_day.sh" "$factor" -- make setup)
TIMEFORMAT="time_setup: first make setup %R s wall, %U s user + %S s sys CPU"
time (cd "$work/clone" && "${run[@]}" > "$work/setup.log" 2>&1) || { tail -30 "$work/setup.log"; exit 1; }
echo "time_setup: load after: $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E '^setup: (torch|vLLM)|^slow_day.sh: exit' "$work/setup.log" || true
TIMEFORMAT="time_setup: second make setup %R s wall"
time (cd "$work/clone" && make setup > "$work/setup2.log" 2>&1)
grep -q "is up to date" "$work/setup2.log" || { echo "time_setup: the second make setup was not a no-op" >&2; exit 1; }
