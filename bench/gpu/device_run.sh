#!/usr/bin/env bash
# What runs on the lent GPU machine, one step per device call (docs/gpu.md has the whole sequence).
#   bash bench/gpu/device_run.sh copy       copy the carried chunk folders (wheels-gpu/c*) to $W
#   bash bench/gpu/device_run.sh build      start building the 8B-shape target in the background (~20 s); after
#                                           install: its tokenizer comes from eagle3_workflow, which needs pydantic
#   bash bench/gpu/device_run.sh install    reassemble + verify + install the wheels into $T (bench/gpu/install.sh)
#   bash bench/gpu/device_run.sh pipeline   the real Snakemake rules on $CONFIG (default bench/gpu/llama8b-shape.yaml),
#                                           run in $WORK (/root/work), outside the carried tree: results survive
#                                           between the calls of one lease (each call re-syncs the code, not results)
#     CONFIG=config/presets/smollm2-135m-gpu.yaml bash bench/gpu/device_run.sh pipeline collect
#     CONFIG="preset.yaml overlay.yaml"   several config files, merged in order (run name and target from the first)
#     SNAKE_ARGS="-R train_draft" ...     extra snakemake arguments
#   bash bench/gpu/device_run.sh bench      bench/gpu/bench_gpu.py (extraction and training side by side)
#   bash bench/gpu/device_run.sh faultcheck the lossless check on this GPU against EAGLE3_FAULT=accept_any_draft
#   bash bench/gpu/device_run.sh online     train_draft online against offline on the finished run's data
#                                           (bench/gpu/online_vs_offline_gpu.py; ROWS=2000 EPOCHS=1 by default;
#                                           online at train.online.requests_in_flight first, then at each count in
#                                           RIF (default 1: speculators' serial fetch, the before; RIF=8, the
#                                           configured count, runs that one only); the report is written after each
#                                           mode; the 2,000-row serial run took ~200 s on the H200: ONLINE_TIMEOUT,
#                                           540 s by default; ONLINE_ARGS=--online-first: online before offline,
#                                           for a machine whose kernel cache is cold)
#   bash bench/gpu/device_run.sh restore    RESTORE=<bundle folder>: build the target in $WORK, then put an earlier
#                                           lease's check_target and regenerate_responses outputs into the run
#                                           (bench/gpu/restore_run.py checks target, settings and sha256 first)
#   bash bench/gpu/device_run.sh shm        SHM="canary train"|run: the canary's slice, the trainer's work folder (or
#                                           the whole run) in /dev/shm, for the real-width Kimi stand-in (docs/gpu.md);
#                                           before pipeline
#   bash bench/gpu/device_run.sh data       the SmolLM2 preset's regenerated conversations (a restore bundle) unpacked
#                                           into $WORK/bench-data/, for bench/gpu/llama8b-shape-speed.yaml
#   bash bench/gpu/device_run.sh collect    logs, small artefacts and each run folder's sizes (du) into $OUT
# Several steps in one call: bash bench/gpu/device_run.sh copy install pipeline collect
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${W:-/root/wheelcache}
T=${T:-/tmp/site}
TARGET=${TARGET:-/root/targets/llama8b-shape}
CONFIG=${CONFIG:-bench/gpu/llama8b-shape.yaml}
WORK=${WORK:-/root/work}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# NVLink multicast stays off (workplace rule), also for the processes the workflow starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the config's run name and target path (RUN overrides the name); the image has PyYAML
config_value() { python3 -c 'import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); k = sys.argv[2].split("."); v = c.get(k[0]) if len(k) == 1 else (c.get(k[0]) or {}).get(k[1]); print(v if v is not None else "")' "${CONFIG%% *}" "$1"; }
RUN=${RUN:-$(config_value run)}
RUN=${RUN:-gpu-llama8b-shape}
stamp() { echo "[device_run $(date -u +%H:%M:%S)] $*"; }
use_site() { [ -f "$T/ENV.sh" ] && source "$T/ENV.sh"; export PYTHONPATH="$PWD/workflow/scripts${PYTHONPATH:+:$PYTHONPATH}"; }

step_copy() {
  mkdir -p "$W"
  for d in wheels-gpu/c*; do [ -d "$d" ] && cp -n "$d"/* "$W"/ 2>/dev/null; done
  stamp "wheel cache: $(ls "$W" | wc -l) files, $(du -sh "$W" | cut -f1)"
}

step_build() {
  if [ -f "$TARGET/.built.json" ]; then stamp "target exists: $(cat "$TARGET/.built.json")"; return 0; fi
  # the build imports eagle3_workflow (its tokenizer), and that needs the carried wheels (pydantic): the image lacks
  # them (2026-12-06: a build started before install died at `import pydantic`, and pipeline waited on it)
  [ -f "$T/ENV.sh" ] || { stamp "build: the wheels are not installed yet ($T/ENV.sh). Fix: run install first (install build ...)"; return 2; }
  use_site
  mkdir -p "$(dirname "$TARGET")"
  stamp "building $TARGET in the background (log /root/build_target.log)"
  # setsid: the build outlives this call (the machine keeps it while it is warm)
  setsid bash -c "python3 bench/gpu/build_8b_shape_target.py '$TARGET.tmp' >/root/build_target.log 2>&1 \
    && tail -1 /root/build_target.log > '$TARGET.tmp/.built.json' && rm -rf '$TARGET' && mv '$TARGET.tmp' '$TARGET'" \
    </dev/null >/dev/null 2>&1 &
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__, torch.cuda.is_available())'
}

wait_build() {
  for _ in $(seq 1 600); do
    [ -f "$TARGET/.built.json" ] && { stamp "target: $(cat "$TARGET/.built.json")"; return 0; }
    if ! pgrep -f build_8b_shape_target >/dev/null; then stamp "target build failed:"; tail -30 /root/build_target.log; return 1; fi
    sleep 1
  done
  return 1
}

step_install() {
  step_copy
  W=$W T=$T bash "$W/install.sh" || return 1
  step_check
}

step_check() {
  use_site
  python3 -c 'import vllm, speculators, hs_connectors, torch, transformers, snakemake; from importlib.metadata import version as v; print({n: v(n) for n in ("vllm", "speculators", "hs-connectors", "torch", "transformers", "snakemake")})' || return 1
  # every distribution the run imports from, with where it came from (image or carried), for envs/gpu.yaml
  python3 - "$T" >"$OUT/versions.json" <<'PYEOF'
import importlib.metadata as m, json, platform, sys
site = sys.argv[1]
out = {"python": platform.python_version(), "carried": {}, "image": {}}
for d in m.distributions():
    name = d.metadata["Name"]
    where = "carried" if str(d.locate_file("")).startswith(site) else "image"
    out[where].setdefault(name.lower(), d.version)
print(json.dumps(out, indent=1, sort_keys=True))
PYEOF
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); i=d["image"]; print({k: i.get(k) for k in ("torch","transformers","triton","tokenizers","safetensors","numpy","pandas","huggingface-hub","protobuf","packaging","typing-extensions","fsspec","httpx","pyyaml")})' "$OUT/versions.json"
}

# the code of this call into $WORK; its results/ and .snakemake/ stay from earlier calls of the lease (the carried
# tree is replaced on every call, and ignored folders it does not carry are gone). Only files whose bytes differ are
# copied: the carried copy's mtimes are new on every call, and a newer data file would make Snakemake rerun
# prepare_data and everything after it.
sync_work() {
  python3 - "$PWD" "$WORK" <<'PYEOF'
import filecmp, os, shutil, sys
src, dst = sys.argv[1:3]
skip = {"results", ".snakemake", "wheels-gpu", ".venv"}
copied = 0
for root, dirs, files in os.walk(src):
    # bytecode caches are the interpreter's, not code: a stale .pyc in the source (an edit after `make setup`
    # compiled it) is rewritten in $WORK by the first import there, and every later sync would count it changed
    dirs[:] = [d for d in dirs if d != "__pycache__" and not (root == src and d in skip)]
    target = os.path.join(dst, os.path.relpath(root, src))
    os.makedirs(target, exist_ok=True)
    for name in files:
        a, b = os.path.join(root, name), os.path.join(target, name)
        if os.path.islink(a) or not os.path.isfile(a):
            continue
        if not (os.path.isfile(b) and filecmp.cmp(a, b, shallow=False)):
            shutil.copy2(a, b)
            copied += 1
print(f"[device_run] synced {src} -> {dst}: {copied} files changed")
PYEOF
}

step_pipeline() {
  use_site
  # only a config whose target is the 8B-shape model waits for its background build
  if [ "$(config_value target.path)" = "$TARGET" ]; then wait_build || return 1; fi
  sync_work
  cd "$WORK" || return 1
  export PYTHONPATH="$WORK/workflow/scripts${PYTHONPATH:+:$PYTHONPATH}"
  stamp "snakemake: $CONFIG (run $RUN) in $WORK ${SNAKE_ARGS:-}"
  # a call that ran out of time left a lock and incomplete outputs: this call resumes (finished rules are kept)
  [ -n "$(ls .snakemake/locks 2>/dev/null)" ] && snakemake --unlock --configfile $CONFIG >/dev/null 2>&1
  # GPU memory and utilisation once a second, for each stage's peak (its rows between the stage's start and end in
  # the Snakemake log): gpu-<HHMMSS>.csv, one file per call
  local sampler=""
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv,noheader -l 1 >"$OUT/gpu-$(date -u +%H%M%S).csv" 2>/dev/null &
    sampler=$!
  fi
  timeout "${PIPELINE_TIMEOUT:-540}" snakemake --cores 16 --rerun-incomplete --printshellcmds ${SNAKE_ARGS:-} --configfile $CONFIG 2>&1 | tee "$OUT/snakemake-$RUN.log" | grep -E "^(rule |\[|Finished|Error|.*Exception|.*FAILED|.*error)" | grep -v "^\[vllm\]" | tail -80
  local rc=${PIPESTATUS[0]}
  [ -n "$sampler" ] && kill "$sampler" 2>/dev/null
  stamp "snakemake exit $rc"
  for f in checks/api_compat.json checks/canary.json hidden_states/replica_0.json hidden_states/validation.json draft/training.json eval/acceptance.json; do
    [ -f "results/$RUN/$f" ] && echo "== $f: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in list(d)[:12] if not isinstance(d[k], (list, dict)) or k in ('ratios','per_layer_max_rel_error','layer_ids')})" "results/$RUN/$f")"
  done
  cd - >/dev/null || true
  return "$rc"
}

# an earlier lease's regenerated data into this lease's run (docs/gpu.md, "2. The SmolLM2-135M preset"): the target is built
# by its own rule first, restore_run.py refuses a bundle whose target, settings or bytes differ, and Snakemake's
# plan must then start at prepare_data
step_restore() {
  use_site
  [ -n "${RESTORE:-}" ] || { stamp "restore: set RESTORE=<bundle folder> (e.g. bench/gpu/results/<date>-<run>/restore)"; return 2; }
  local bundle repo=$PWD
  bundle=$(cd "$RESTORE" && pwd) || { stamp "restore: no folder $RESTORE"; return 2; }
  sync_work
  cd "$WORK" || return 1
  export PYTHONPATH="$WORK/workflow/scripts${PYTHONPATH:+:$PYTHONPATH}"
  [ -n "$(ls .snakemake/locks 2>/dev/null)" ] && snakemake --unlock --configfile $CONFIG >/dev/null 2>&1
  stamp "restore: building results/$RUN/target, then $bundle into results/$RUN"
  # the target before --configfile, which takes every word after it as a config file
  timeout "${RESTORE_TIMEOUT:-300}" snakemake "results/$RUN/target" --cores 16 --configfile $CONFIG >"$OUT/restore-build.log" 2>&1 \
    || { tail -30 "$OUT/restore-build.log"; stamp "restore: the target build failed"; cd "$repo"; return 1; }
  python3 "$repo/bench/gpu/restore_run.py" unpack "$bundle" "results/$RUN" --config $CONFIG --repo "$WORK" \
    || { cd "$repo"; return 3; }
  local plan
  plan=$(snakemake -n --quiet rules --configfile $CONFIG 2>&1)
  # the job-stats table's rows only (the reasons may name other rules' files)
  plan=$(echo "$plan" | grep -E "^[a-z_0-9]+ +[0-9]+$")
  echo "$plan"
  if echo "$plan" | awk '{print $1}' | grep -qxE "check_target|regenerate_responses"; then
    stamp "restore did not take: Snakemake still plans the regeneration (above)"; cd "$repo"; return 3
  fi
  cd "$repo" || true
}

step_bench() {
  use_site
  wait_build || return 1
  # the pipeline's checkpoints (~3.7 GB each for this shape) are not needed any more: the disk is 64 GiB
  rm -rf "$WORK/results/$RUN/checks/canary_work/model"
  df -h /root | tail -1
  stamp "bench_gpu.py"
  timeout "${BENCH_TIMEOUT:-560}" python3 bench/gpu/bench_gpu.py --target "$TARGET" --work /root/bench-work \
    --samples "${SAMPLES:-128}" --seq-len "${SEQ_LEN:-2048}" --concurrency "${CONCURRENCY:-64}" \
    --train-epochs "${EPOCHS:-2}" ${EAGER:+--eager} ${BENCH_ARGS:-} --out "$OUT/bench_gpu.json" 2>&1 \
    | tee "$OUT/bench_gpu.log" | grep -v "^\[vllm\]" | tail -60
  return "${PIPESTATUS[0]}"
}

step_online() {
  use_site
  sync_work  # this call's code: the bench runs from $WORK, where the pipeline call left its own
  cd "$WORK" || return 1
  export PYTHONPATH="$WORK/workflow/scripts${PYTHONPATH:+:$PYTHONPATH}"
  # the bench reads the run's resolved config from provenance.json, a rule with no inputs that a run cut by
  # `--until validate_hidden_states` never reaches (2026-12-07, on CPU): written here first (the target first, as
  # --configfile takes every word after it)
  if [ ! -f "results/$RUN/provenance.json" ]; then
    snakemake "results/$RUN/provenance.json" --cores 1 --configfile $CONFIG >"$OUT/provenance.log" 2>&1 \
      || { tail -20 "$OUT/provenance.log"; stamp "online: results/$RUN/provenance.json could not be written"; cd - >/dev/null; return 1; }
  fi
  stamp "online_vs_offline_gpu.py on results/$RUN (${ROWS:-2000} rows, ${EPOCHS:-1} epoch(s))"
  timeout "${ONLINE_TIMEOUT:-540}" python3 bench/gpu/online_vs_offline_gpu.py "results/$RUN" --rows "${ROWS:-2000}" \
    --epochs "${EPOCHS:-1}" ${RIF:+--requests-in-flight $RIF} ${ONLINE_ARGS:-} --work /root/online-bench --out "$OUT/online_vs_offline.json" 2>&1 \
    | tee "$OUT/online_vs_offline.log" | grep -E "^\[device_run|online training|attempt|draft trained|Error|error|^\{|^  \"" | tail -60
  local rc=${PIPESTATUS[0]}
  cp /root/online-bench/online/train_work/online/vllm_server.log "$OUT/online_vllm_server.log" 2>/dev/null
  cd - >/dev/null || true
  return "$rc"
}

# the lossless check against a deliberately wrong acceptance, on this GPU (bench/gpu/lossless_fault.py): exit 0
# when the check fails the faulty run, as it must
step_faultcheck() {
  use_site
  timeout "${FAULT_TIMEOUT:-400}" python3 bench/gpu/lossless_fault.py "$WORK/results/$RUN" --out "$OUT/lossless_fault.json" 2>&1 | tail -30
  return "${PIPESTATUS[0]}"
}

# the real-width Kimi-K2.5 stand-in (docs/gpu.md): its 54 GB checkpoint and the canary's ~11 GB slice do not both
# fit the 64 GiB disk. SHM=canary (the default): the canary's scratch folder, where it writes its slice, in /dev/shm
# (memory) through a link; SHM="canary train": its trainer's work folder too (two 6.9 GB checkpoints beside the target
# overflowed the disk on 2026-12-06); SHM=run: the whole run folder there (when the disk has less than ~60 GiB free).
# Before the pipeline step; /dev/shm goes with the machine
step_shm() {
  df -h "$WORK" /dev/shm 2>/dev/null || df -h / /dev/shm
  local dest="/dev/shm/$RUN" part
  for part in ${SHM:-canary}; do
    case $part in
      run)
        mkdir -p "$WORK/results" "$dest"
        [ -L "$WORK/results/$RUN" ] || { [ -d "$WORK/results/$RUN" ] && cp -a "$WORK/results/$RUN/." "$dest/" && rm -rf "$WORK/results/$RUN"; ln -s "$dest" "$WORK/results/$RUN"; } ;;
      canary)
        mkdir -p "$WORK/results/$RUN/checks" "$dest-canary_work"
        ln -sfn "$dest-canary_work" "$WORK/results/$RUN/checks/canary_work" ;;
      train)
        # the trainer's checkpoints (6.9 GB each for the real-width Kimi draft) beside a 54 GB target overflow the
        # 64 GiB disk (2026-12-06): train_work in memory, before train_draft first runs
        mkdir -p "$WORK/results/$RUN" "$dest-train_work"
        [ -L "$WORK/results/$RUN/train_work" ] || { [ -d "$WORK/results/$RUN/train_work" ] && cp -a "$WORK/results/$RUN/train_work/." "$dest-train_work/" && rm -rf "$WORK/results/$RUN/train_work"; ln -s "$dest-train_work" "$WORK/results/$RUN/train_work"; } ;;
      *) stamp "shm: SHM=$part is none of run, canary, train"; return 2 ;;
    esac
  done
  stamp "in /dev/shm (${SHM:-canary}): $(ls -l "$WORK/results/$RUN" "$WORK/results/$RUN/checks/canary_work" 2>/dev/null | grep -- '->' | sed 's/.* \([^ ]* -> [^ ]*\)$/\1/' | tr '\n' ' ')"
}

# The stdlib stubs (since 2026-12-07's bundle) are left out: the 8B-shape runs keep the 2026-12-06 run's mix, the
# 306 shipped prompts then the Magpie turns in the same order (a stub's short prompt and answer would move the
# per-conversation token count that bench/gpu/llama8b-shape-speed.yaml's data size was chosen by)
step_data() {
  mkdir -p "$WORK/bench-data"
  python3 -c 'import json, lzma, sys
with lzma.open(sys.argv[1], "rt") as src, open(sys.argv[2], "w") as dst:
    dst.writelines(line for line in src if not json.loads(line)["origin"].startswith("python311_stdlib_stubs"))' \
    bench/gpu/results/2026-12-07-smollm2-135m-gpu/restore/regenerated.jsonl.xz "$WORK/bench-data/smollm2-regenerated.jsonl.tmp" \
    && cmp -s "$WORK/bench-data/smollm2-regenerated.jsonl.tmp" "$WORK/bench-data/smollm2-regenerated.jsonl" \
    && rm "$WORK/bench-data/smollm2-regenerated.jsonl.tmp" \
    || mv "$WORK/bench-data/smollm2-regenerated.jsonl.tmp" "$WORK/bench-data/smollm2-regenerated.jsonl"
  stamp "data: $(wc -l <"$WORK/bench-data/smollm2-regenerated.jsonl") conversations in $WORK/bench-data/smollm2-regenerated.jsonl"
}

step_collect() {
  # the bench's own logs (its servers', the trainers'), with or without a pipeline run in this lease
  [ -d /root/bench-work ] && tar -czf "$OUT/bench-logs.tar.gz" -C /root/bench-work --exclude='*.safetensors' \
    --exclude='*.pt' --exclude='*.npy' --exclude='*files*' --exclude='data' --exclude='*checkpoints*' . 2>/dev/null
  [ -d "$WORK/results/$RUN" ] || { ls -la "$OUT"; return 0; }
  # what each stage wrote to disk (bytes, every file and folder three levels down), before anything is left out
  du -ab --count-links --max-depth=3 -L "$WORK/results/$RUN" >"$OUT/du-$RUN.txt" 2>/dev/null
  # -h: a run folder linked into /dev/shm (step_shm) is archived by its contents
  tar -h -czf "$OUT/results-$RUN.tar.gz" --exclude='hidden_states/files' --exclude='*.safetensors' \
    --exclude='train_work/checkpoints' --exclude='*.pt' --exclude='*.npy' --exclude='canary_work/model' \
    --exclude='scratch_replica_*' --exclude='*.arrow' --exclude='measure_*.result.json' -C "$WORK/results" "$RUN" 2>/dev/null
  # a file over 16 MiB does not come back from the device (the prepared data's .arrow files are left out above:
  # ~50 MB for 3M tokens, and prepare_data remakes them from regenerated.jsonl)
  [ "$(stat -c %s "$OUT/results-$RUN.tar.gz")" -le $((16 * 1024 * 1024)) ] \
    || stamp "WARNING: results-$RUN.tar.gz is over 16 MiB and will not come back; leave more out"
  ls -la "$OUT"
}

rc=0
for s in "$@"; do
  "step_$s" || { rc=$?; stamp "step $s failed ($rc)"; [ "$s" = collect ] || step_collect; exit "$rc"; }
done
exit $rc
