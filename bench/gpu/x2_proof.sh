#!/usr/bin/env bash
# Issue 14 on two real GPUs (nvidia-h200-x2), one step per device call, after device_run.sh's copy/build/install
# (docs/gpu-local.md, "Two GPUs"). Every run uses the real rules with --resources gpu=2, so the GPU placement decides
# which device each job gets. Figures and logs go to $OUT/x2/.
#   tp1       check_api + canary + extraction, 1 replica x TP=1 (run gpu-x2-tp1)
#   tp2       the same with tensor_parallel_size 2 on 2 GPUs (run gpu-x2-tp2)
#   replicas  2 replicas x 1 GPU at once, nvidia-smi sampled every 2 s (run gpu-x2-r2); compared with tp1
#   ddp1      train_draft on tp1's hidden states with train.gpus 1; ddp2: the same with train.gpus 2 (torchrun DDP)
#   report    x2_compare.py: tok/s, identical outputs, wall times, loss curves, steps/s -> $OUT/x2/x2.json
set -uo pipefail
cd "$(dirname "$0")/../.."
T=${T:-/tmp/site}
OUT=${OUT:-/tmp/out}
BASE=${BASE:-bench/gpu/llama8b-shape.yaml}
X=$OUT/x2
mkdir -p "$X" /root/x2
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast off
[ -f "$T/ENV.sh" ] && source "$T/ENV.sh"
export PYTHONPATH="$PWD/workflow/scripts${PYTHONPATH:+:$PYTHONPATH}"
stamp() { echo "[x2 $(date -u +%H:%M:%S)] $*"; }

overlay() {  # overlay NAME RUN YAML-BODY: a config file laid over $BASE (later config files win, merged deeply)
  printf 'run: %s\n%s\n' "$2" "$3" > "/root/x2/$1.yaml"
  echo "/root/x2/$1.yaml"
}

snake() {  # snake NAME OVERLAY TARGET...: the real rules, GPU count declared, output kept in $X
  local name=$1 cfg=$2; shift 2
  [ -n "$(ls .snakemake/locks 2>/dev/null)" ] && snakemake --unlock --configfile "$BASE" "$cfg" >/dev/null 2>&1
  stamp "$name: snakemake $*"
  local t0; t0=$(date +%s%N)
  timeout "${STEP_TIMEOUT:-560}" snakemake --cores 32 --resources gpu=2 --rerun-incomplete --printshellcmds "$@" \
    --configfile "$BASE" "$cfg" > "$X/snakemake-$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"wall_ms\": $((($(date +%s%N) - t0) / 1000000))}" > "$X/wall-$name.json"
  grep -E "^(rule |Finished|Error)|FAILED|gpu placement" "$X/snakemake-$name.log" | tail -30
  stamp "$name: exit $rc"
  return $rc
}

collect_logs() {  # collect_logs RUN: the stage logs and small JSON artefacts
  mkdir -p "$X/$1"
  cp -r "results/$1/logs" "$X/$1/" 2>/dev/null
  (cd "results/$1" && find . -name '*.json' -size -2M -not -path './hidden_states/files/*' -exec cp --parents {} "$X/$1/" \;) 2>/dev/null
  [ -f "results/$1/draft/metrics.csv" ] && cp "results/$1/draft/metrics.csv" "$X/$1/"
  return 0
}

extraction_run() {  # extraction_run NAME RUN OVERLAY-BODY
  local cfg; cfg=$(overlay "$1" "$2" "$3")
  snake "$1" "$cfg" "results/$2/hidden_states/validation.json"
  local rc=$?
  collect_logs "$2"
  return $rc
}

step_tp1() { extraction_run tp1 gpu-x2-tp1 'extraction: {replicas: 1, gpus_per_replica: 1, tensor_parallel_size: 1}'; }
step_tp2() { extraction_run tp2 gpu-x2-tp2 'extraction: {replicas: 1, gpus_per_replica: 2, tensor_parallel_size: 2}'; }

step_replicas() {
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 2 > "$X/nvidia-smi.csv" &
  local sampler=$!
  extraction_run replicas gpu-x2-r2 'extraction: {replicas: 2, gpus_per_replica: 1, tensor_parallel_size: 1}'
  local rc=$?
  kill "$sampler"
  return $rc
}

train_run() {  # train_run NAME GPUS: train_draft of the tp1 run (train.* changed: only training reruns)
  local cfg; cfg=$(overlay "$1" gpu-x2-tp1 "extraction: {replicas: 1, gpus_per_replica: 1, tensor_parallel_size: 1}
train: {gpus: $2}")
  # a fresh start, never a resume from the other GPU count's checkpoints
  rm -rf results/gpu-x2-tp1/train_work
  snake "$1" "$cfg" --until train_draft "results/gpu-x2-tp1/draft"
  local rc=$?
  collect_logs gpu-x2-tp1
  mkdir -p "$X/$1" && cp results/gpu-x2-tp1/draft/metrics.csv results/gpu-x2-tp1/draft/*.json "$X/$1/" 2>/dev/null
  cp results/gpu-x2-tp1/logs/train_draft.log "$X/$1/" 2>/dev/null
  return $rc
}

step_ddp1() { train_run ddp1 1; }
step_ddp2() { train_run ddp2 2; }

step_report() {
  python3 bench/gpu/x2_compare.py --results results --out-dir "$X" > "$X/x2.json"
  cat "$X/x2.json"
}

rc=0
for s in "$@"; do
  "step_$s" || { rc=$?; stamp "step $s failed ($rc)"; }
done
exit $rc
