#!/usr/bin/env bash
# Two GPU-machine jobs at once, each on half of the machine: half A gets the
# first half of the GPUs and of the physical CPU cores (with their SMT
# siblings: scripts/cpu_halves.py), half B the rest, each with its own
# OUT ($OUT/a, $OUT/b), WORKDIR, DB_ROOT (kept while the machine is warm, so
# a later call's half continues its database), tracker and server ports, and
# CUDA_VISIBLE_DEVICES (the half's first GPU, for what a job runs locally:
# validation, latency, benchmarks). Waits for both; exits non-zero if either
# failed. Each job is a command line run with bash in the repository root;
# each half's files come back as $OUT/a.tgz and $OUT/b.tgz (the job's log in
# job.log there).
#
#   bash scripts/gpu_halves.sh "<job A>" "<job B>"
#   e.g. bash scripts/gpu_halves.sh \
#     "POOL=1 bash scripts/gpu_chunk.sh MODEL=resnet50 TARGET=cuda BUCKETS=1 PRECISION=fp32 BUDGET=6m" \
#     "POOL=1 bash scripts/gpu_chunk.sh MODEL=resnet50 TARGET=cuda BUCKETS=64 BUDGET=6m"
#
# In a job: $GPUS lists its GPUs ("0 1"), and scripts/gpu_chunk.sh (POOL=1)
# starts its servers on them alone. "" as a job leaves that half idle.
# DB_ROOT_A / DB_ROOT_B name a half's database root instead, e.g.
# DB_ROOT_B=/tmp/tuning_logs to go on with what a whole-machine chunk tuned.
# On one GPU both halves share it: only for jobs that do not time kernels.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash scripts/gpu_halves.sh \"<job A>\" \"<job B>\"" >&2; exit 2; }
OUT=${OUT:-/tmp/out}
read -r -a all_gpus <<< "$(nvidia-smi -L | sed -n 's/^GPU \([0-9]*\):.*/\1/p' | tr '\n' ' ')"
g=${#all_gpus[@]}
[ "$g" -ge 1 ] || { echo "error: nvidia-smi lists no GPU" >&2; exit 2; }
# CPU halves of whole physical cores (SMT siblings kept together; the core map goes to $OUT/cpus.txt).
mkdir -p "$OUT"
{ read -r cpus_a; read -r cpus_b; } < <(python3 scripts/cpu_halves.py 2> "$OUT/cpus.txt") || true
[ -n "${cpus_a:-}" ] && [ -n "${cpus_b:-}" ] || { echo "error: could not split the CPUs in two: $(cat "$OUT/cpus.txt")" >&2; exit 2; }
half_g=$(( g > 1 ? g / 2 : 1 ))

run_half() {  # name, GPU list, CPU list, tracker port, server port base, job
  local name=$1 gpus=$2 cpu_list=$3 tport=$4 pbase=$5 job=$6
  [ -n "$job" ] || return 0
  mkdir -p "$OUT/$name"
  echo "half $name: GPUs $gpus, CPUs $cpu_list: $job" | tee "$OUT/$name/half.txt"
  local db_var="DB_ROOT_${name^^}"
  OUT="$OUT/$name" WORKDIR="/tmp/ws-$name" DB_ROOT="${!db_var:-/tmp/tuning_logs-$name}" GPUS="$gpus" \
    TRACKER_PORT=$tport PORT_BASE=$pbase CUDA_VISIBLE_DEVICES="${gpus%% *}" \
    taskset -c "$cpu_list" bash -c "$job" > "$OUT/$name/job.log" 2>&1
}

run_half a "${all_gpus[*]:0:half_g}" "$cpus_a" 9190 9090 "$1" & pa=$!
run_half b "${all_gpus[*]:g-half_g:half_g}" "$cpus_b" 9290 9300 "$2" & pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
echo "half a: exit $ra; half b: exit $rb"
tail -n 5 "$OUT"/a/job.log "$OUT"/b/job.log 2>/dev/null
# The device tool brings back 8 files at most: one archive per half.
for name in a b; do
  [ -d "$OUT/$name" ] && tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
done
[ $ra -eq 0 ] && [ $rb -eq 0 ]
