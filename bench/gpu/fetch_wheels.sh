#!/usr/bin/env bash
# Here (a machine with PyPI): download the wheel set that runs this workflow on the lent H200 machine (no network
# there; image: Python 3.12, torch 2.11.0+cu130, transformers 5.17.0), check it, and pack it into chunks that each
# travel in one device call (the tree plus what a call carries must stay under 64 MiB).
#
#   bash bench/gpu/fetch_wheels.sh [SETS]      SETS: core (default), snakemake, smollm2, or several: "core snakemake"
#
# Output: wheels-gpu/ in the repository root (ignored by .gitignore): all/ (the wheels), c1/ c2/ ... (chunks: the
# big vLLM wheel split into parts, then first-fit-decreasing packing of everything), each chunk self-sufficient to
# copy; the last one also holds install.sh and the lists. SHA256SUMS in this folder pins every file: a download
# whose hash differs stops here (pip may pick another platform tag of the same version on another day: then
# review and update SHA256SUMS deliberately). Pins with no wheel on PyPI (connection-pool 0.0.3): the sdist is
# pinned and checked, and wheelset.py builds its wheel byte-reproducibly (so that pin holds too). Exactly one
# file per distribution, also on a rerun into the same folder (two stop the single pip install on the device).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${WHEELS_OUT:-$repo/wheels-gpu}
sets=${1:-core snakemake}
chunk_mib=${CHUNK_MIB:-52}  # 61 left the tree under 3 MiB: at 3.9 MiB (2026-12-02) a chunk no longer fit one call;
# 56 refused a call on 2026-12-06 with 8.12 MB tracked (the device tool counts more than the files' bytes)
all=$out/all
mkdir -p "$all"
plat=(--platform any)
for n in $(seq 39 -1 12); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
: >"$out/WHEELS.txt"
for s in $sets; do
  list=$here/wheels-$s.txt
  [ -f "$list" ] || { echo "no list $list" >&2; exit 2; }
  # PIP_CONFIG_FILE=/dev/null: this host's pip config adds a constraints file meant for its own Python 3.11 env
  if ! PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$all" -r "$list" 2>"$out/pip.err"; then
    # a few pure-Python pins exist only as sdists (connection-pool 0.0.3): the sdist (PyPI's bytes, pinned in
    # SHA256SUMS) is checked, then wheelset.py builds the wheel from it byte-reproducibly (pip wheel cannot: its
    # output follows this machine's setuptools and zlib), so the wheel's pin holds on any machine
    grep -v '^#' "$list" | grep . | while read -r pin; do
      PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d "$all" "$pin" 2>/dev/null && continue
      echo "no wheel for $pin: building one from its pinned sdist"
      mkdir -p "$out/sdist"
      PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --no-binary=:all: -d "$out/sdist" "$pin"
      norm=$(echo "${pin%%==*}" | tr 'A-Z-.' 'a-z__'); ver=${pin##*==}
      sdist=$(cd "$out/sdist" && ls | grep -i "^${norm}-${ver}\.tar\.gz$") \
        || { echo "no sdist ${norm}-${ver}.tar.gz for $pin" >&2; exit 5; }
      (cd "$out/sdist" && grep " ${sdist}\$" "$here/SHA256SUMS" | sha256sum -c --quiet) \
        || { echo "the sdist $sdist is not pinned in SHA256SUMS or differs from its pin" >&2; exit 5; }
      python3 "$here/wheelset.py" sdist-wheel "$out/sdist/$sdist" "$all" >/dev/null
    done
  fi
  # pins whose verified file has another platform tag than the one pip picks now: keep exactly that file, and
  # only it (a rerun downloads pip's pick again next to it: two wheels of one distribution break the install)
  grep -v '^#' "$list" | grep . | while read -r pin; do
    norm=$(echo "${pin%%==*}" | tr 'A-Z-.' 'a-z__'); ver=${pin##*==}
    tested=$(awk '{print $2}' "$here/SHA256SUMS" | grep -i "^${norm}-${ver}-.*\.whl$" || true)
    [ -n "$tested" ] || continue
    (cd "$all" && ls | grep -i "^${norm}-${ver}-" | grep -v -x -F "$tested" | xargs -r rm -f) || true
    [ -e "$all/$tested" ] && continue
    tags=$(echo "$tested" | sed 's/\.whl$//' | awk -F- '{print $NF}' | tr '.' ' ')
    args=(); for t in $tags; do args+=(--platform "$t"); done
    echo "fetching the tested file $tested"
    PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${args[@]}" -d "$all" "$pin"
  done
  # the file names of this set's pins (pip normalises - and _ and case: match on the normalised project name)
  grep -v '^#' "$list" | sed -n 's/==.*//p' | while read -r name; do
    norm=$(echo "$name" | tr 'A-Z-.' 'a-z__')
    (cd "$all" && ls | grep -i "^${norm}-" | grep -v '\.part-' || { echo "missing wheel for $name" >&2; exit 3; })
  done >>"$out/WHEELS.txt"
done
sort -u -o "$out/WHEELS.txt" "$out/WHEELS.txt"
# one file per distribution, always (two platform tags or versions of one: pip's single install fails)
python3 "$here/wheelset.py" duplicates $(cat "$out/WHEELS.txt") \
  || { echo "remove the extra files from $all (or start from an empty $out)" >&2; exit 6; }
# verify against the pinned hashes (lines of other sets are ignored)
(cd "$all" && grep -F -f "$out/WHEELS.txt" "$here/SHA256SUMS" >"$out/SHA256SUMS.want" || true)
have=$(wc -l <"$out/SHA256SUMS.want")
want=$(wc -l <"$out/WHEELS.txt")
if [ "$have" -ne "$want" ]; then
  echo "SHA256SUMS pins $have of the $want wheels; unpinned:" >&2
  grep -v -F -f <(awk '{print $2}' "$out/SHA256SUMS.want") "$out/WHEELS.txt" >&2 || true
  [ "${PIN_NEW:-0}" = 1 ] || { echo "set PIN_NEW=1 to append their hashes to SHA256SUMS (review first)" >&2; exit 4; }
  (cd "$all" && sha256sum $(grep -v -F -f <(awk '{print $2}' "$out/SHA256SUMS.want") "$out/WHEELS.txt")) >>"$here/SHA256SUMS"
  (cd "$all" && grep -F -f "$out/WHEELS.txt" "$here/SHA256SUMS" >"$out/SHA256SUMS.want")
fi
(cd "$all" && sha256sum -c --quiet "$out/SHA256SUMS.want")
echo "sha256 OK: $want wheels, $(cd "$all" && du -cb $(cat "$out/WHEELS.txt") | tail -1 | cut -f1) bytes"
# pack: split files over the chunk size into parts, then first-fit decreasing
rm -rf "$out"/c[0-9]* "$out/pieces"
mkdir -p "$out/pieces"
limit=$((chunk_mib * 1024 * 1024))
while read -r f; do
  if [ "$(stat -c %s "$all/$f")" -gt "$limit" ]; then
    (cd "$out/pieces" && split -b "${chunk_mib}M" "$all/$f" "$f.part-")
  else
    ln "$all/$f" "$out/pieces/$f" 2>/dev/null || cp "$all/$f" "$out/pieces/$f"
  fi
done <"$out/WHEELS.txt"
cp "$here/install.sh" "$out/SHA256SUMS.want" "$out/WHEELS.txt" "$out/pieces/"
python3 - "$out" "$limit" <<'PY'
import os, sys
out, limit = sys.argv[1], int(sys.argv[2])
pieces = os.path.join(out, "pieces")
items = sorted(((os.path.getsize(os.path.join(pieces, f)), f) for f in os.listdir(pieces)), reverse=True)
bins = []  # [free, [names]]
for size, name in items:
    for b in bins:
        if b[0] >= size:
            b[0] -= size; b[1].append(name); break
    else:
        bins.append([limit - size, [name]])
for i, (_, names) in enumerate(bins, 1):
    d = os.path.join(out, f"c{i}"); os.makedirs(d)
    for n in names:
        os.replace(os.path.join(pieces, n), os.path.join(d, n))
    print(f"c{i}: {len(names)} files, {(limit - bins[i - 1][0]) / 2**20:.1f} MiB")
PY
rmdir "$out/pieces"
echo "chunks: $(ls -d "$out"/c* | xargs -n1 basename | tr '\n' ' ')(copy each to W=/root/wheelcache, then: bash \$W/install.sh)"
