#!/usr/bin/env bash
# On the GPU machine (no network): reassemble, verify and install the carried wheels into $T in ONE pip call
# (separate --target calls clobber shared folders such as bin/), then write $T/ENV.sh.
#   W=/root/wheelcache (every chunk's files, copied flat)   T=/tmp/site
set -euo pipefail
W=${W:-/root/wheelcache}; T=${T:-/tmp/site}; PY=${PY:-python3}
cd "$W"
for p in *.whl.part-aa; do
  [ -e "$p" ] || continue
  w=${p%.part-aa}
  [ -s "$w" ] || cat "$w".part-* >"$w"
done
# fsspec and typing_extensions shadow the image's copies only where the image's version misses vLLM's pin
skip=$(env -u PYTHONPATH "$PY" - <<'PYEOF'
from importlib.metadata import version
from packaging.version import Version as V
skip = []
try:
    if V(version("typing_extensions")) >= V("4.16.0"):
        skip.append("typing_extensions-")
except Exception:
    pass
try:
    if V(version("fsspec")) <= V("2026.7.0"):
        skip.append("fsspec-")
except Exception:
    skip.append("fsspec-")
print(" ".join(skip))
PYEOF
)
LIST=$(cat WHEELS.txt)
for s in $skip; do LIST=$(printf '%s\n' $LIST | grep -v "^$s" || true); done
missing=0
for f in $LIST; do [ -s "$f" ] || { echo "MISSING $f (copy every chunk first)"; missing=1; }; done
[ $missing = 0 ] || exit 1
grep -F -f <(printf '%s\n' $LIST) SHA256SUMS.want | sha256sum -c --quiet
echo "sha256 OK for $(echo $LIST | wc -w) wheels (image's own kept: ${skip:-none})"
rm -rf "$T"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" $LIST
# Bytecode for every installed module, once, on all cores. Without it each process compiles what it imports unless it
# may write .pyc there: on the 8B-shape lease of 2026-12-06 `import vllm` took 10.3-14.9 s in each of five evaluation
# processes, the later ones no faster than the first, and the extraction server's two processes 26 s each before the
# engine began. This line prints whether the image forbids writing .pyc; the next lease's import times say what it saved.
started=$(date +%s)
"$PY" -m compileall -q -j 0 "$T" >/dev/null 2>&1 || echo "compileall: some files did not compile (tests, templates of other Python versions); the modules that did are cached"
echo "bytecode compiled in $(($(date +%s) - started)) s: $(find "$T" -name '*.pyc' | wc -l) .pyc files (PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset})"
# protobuf runtime older than googleapis-common-protos' generated code: vLLM's optional OpenTelemetry import
# then fails softly instead of at import time
if ! env -u PYTHONPATH "$PY" -c 'import google.protobuf as p,sys; from packaging.version import Version as V; sys.exit(V(p.__version__)<V("6.33.5"))'; then
  echo "protobuf < 6.33.5: removing $T/google/rpc"; rm -rf "$T/google/rpc"
fi
PP=$T
[ -d "$T/nvidia_cutlass_dsl/dsl_packages" ] && PP="$T:$T/nvidia_cutlass_dsl/dsl_packages"
# FlashInfer is not in the set: vLLM must not pick its sampler
echo "export PYTHONPATH=$PP\${PYTHONPATH:+:\$PYTHONPATH} PATH=$T/bin:\$PATH VLLM_USE_FLASHINFER_SAMPLER=0" >"$T/ENV.sh"
cat "$T/ENV.sh"
