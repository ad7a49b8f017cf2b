#!/usr/bin/env bash
# A slow day on demand: run a command on a machine whose every core is partly taken by a busy neighbour, e.g.
#
#   bench/suite/slow_day.sh 2 -- .ci/run          # the suite as on a day when each core runs at half speed
#   bench/suite/slow_day.sh 2 -- make demo
#
# On each core a neighbour process, pinned there, takes (FACTOR - 1)/FACTOR of the core's time in every 10 ms (a
# CPU cgroup per core: a weight far above anything else's, capped by a quota), as a hypervisor's other guests
# take time from a virtual CPU. Whatever the command starts, xdist workers, Snakemake, vLLM servers, trainers,
# shares the remaining 1/FACTOR of each core: a single-threaded stage runs FACTOR times slower, and so does
# the whole. (A quota on the command alone would slow only what runs on more than nproc/FACTOR cores at once;
# equal weights would give the command more than its share wherever it runs more threads than cores.)
# This machine kind has run the same suite about 2x apart between days (issue 29); a run at FACTOR 2 shows
# whether the 30-minute budget and every time limit in the tests hold on such a day. Needs root and a CPU cgroup
# (v2 cpu.max/cpu.weight or v1 cpu.cfs_quota_us/cpu.shares); it refuses, with the reason, where it cannot slow
# the machine, rather than run at full speed.
set -euo pipefail

usage() { echo "usage: $0 FACTOR -- COMMAND [ARGS...]   (FACTOR > 1: 2 = half of every core)" >&2; exit 2; }
[[ $# -ge 3 && $2 == "--" ]] || usage
factor=$1
shift 2
awk -v f="$factor" 'BEGIN { exit !(f + 0 > 1) }' || usage

period_us=20000
cpus=$(nproc)
quota_us=$(awk -v p="$period_us" -v n="$cpus" -v f="$factor" 'BEGIN { printf "%d", p * n * (f - 1) / f }')
tag="eagle3-slow-day-$$"
if [[ -w /sys/fs/cgroup/cgroup.subtree_control ]] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
    version=2
    root=/sys/fs/cgroup
    grep -qw cpu "$root/cgroup.subtree_control" || echo "+cpu" > "$root/cgroup.subtree_control"
elif [[ -d /sys/fs/cgroup/cpu && -w /sys/fs/cgroup/cpu ]]; then
    version=1
    root=/sys/fs/cgroup/cpu
else
    echo "slow_day.sh: no writable CPU cgroup here (needs root and cgroup v2 with the cpu controller, or v1's" \
        "cpu hierarchy at /sys/fs/cgroup/cpu): refusing to run at full speed" >&2
    exit 1
fi

groups=()
neighbours=()
neighbour_cpu_s() {  # CPU seconds the neighbours have used so far (utime + stime, /proc/<pid>/stat)
    local pid total=0 ticks
    ticks=$(getconf CLK_TCK)
    for pid in "${neighbours[@]}"; do
        total=$((total + $(awk '{ print $14 + $15 }' "/proc/$pid/stat")))
    done
    awk -v t="$total" -v hz="$ticks" 'BEGIN { printf "%.1f", t / hz }'
}
cleanup() {
    if ((${#neighbours[@]})); then
        kill "${neighbours[@]}" 2>/dev/null || true
        wait "${neighbours[@]}" 2>/dev/null || true
    fi
    local group
    for group in "${groups[@]}"; do  # a group can only go once it is empty, a moment after its processes ended
        for _ in {1..50}; do rmdir "$group" 2>/dev/null && break; sleep 0.1; done
        [[ ! -d $group ]] || echo "slow_day.sh: $group still holds processes; rmdir it once they end" >&2
    done
}
trap cleanup EXIT

# settings are written by the shell: Python's stdout seeks, which a cgroup file refuses
group="$root/$tag-neighbour"
mkdir "$group"
groups+=("$group")
if ((version == 2)); then
    echo 10000 > "$group/cpu.weight"
    echo "$quota_us $period_us" > "$group/cpu.max"
else
    echo 262144 > "$group/cpu.shares"
    echo "$period_us" > "$group/cpu.cfs_period_us"
    echo "$quota_us" > "$group/cpu.cfs_quota_us"
fi
for ((cpu = 0; cpu < cpus; cpu++)); do
    (
        echo "$BASHPID" > "$group/cgroup.procs"
        exec taskset -c "$cpu" python3 -c 'while True: pass'
    ) &
    neighbours+=("$!")
done

echo "slow_day.sh: $cpus neighbours, one pinned to each core, may take $quota_us us of the $cpus x $period_us us" \
    "of CPU time in every $period_us us (the command gets 1/$factor of every core)" >&2
started=$(date +%s.%N)
# the command in the background, so that a TERM, INT or HUP to this script reaches it and the neighbours still go
# (the EXIT trap); stdin stays this script's
set +e
"$@" <&0 &
command_pid=$!
trap 'kill -TERM "$command_pid" 2>/dev/null' TERM INT HUP
wait "$command_pid"
status=$?
while kill -0 "$command_pid" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the command's own end
    wait "$command_pid"
    status=$?
done
set -e
elapsed=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
taken=$(neighbour_cpu_s)
# what the neighbours took is measured, not assumed: the quota is what they may take, and the scheduler's slices
# leave the command a little more than 1/FACTOR
awk -v s="$status" -v e="$elapsed" -v t="$taken" -v n="$cpus" 'BEGIN {
    share = (e > 0) ? t / (e * n) : 0
    printf "slow_day.sh: exit %d after %.0f s; the neighbours took %.1f CPU-s, %.0f%% of the machine: each core ran" \
        " the command %.2fx slower at most\n", s, e, t, 100 * share, (share < 1) ? 1 / (1 - share) : 0 }' >&2
exit "$status"
