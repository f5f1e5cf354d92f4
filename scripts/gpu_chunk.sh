#!/usr/bin/env bash
# One resumable chunk of work on the GPU machine (the `device` tool's H200),
# where TVM comes from the staged bundle and torch/onnx/onnxruntime from the
# image. Tuning databases are kept in $DB_ROOT (default /tmp/tuning_logs),
# which outlives a call while the machine stays warm; it is seeded from the
# committed tuning_logs/ and packed into $OUT/tuning_logs.tgz after the run,
# to be unpacked over tuning_logs/ and committed.
#
#   bash scripts/gpu_chunk.sh <make variables...>
#   e.g. bash scripts/gpu_chunk.sh MODEL=resnet50 TARGET=cuda BUDGET=3m
#
# POOL=1 on a machine with several GPUs: a tracker and one RPC server per GPU
# on loopback, and `make tune` measures on all of them, one tuning lane per
# GPU (see README, "Tuning on a pool of GPUs"). Tracker and server logs go to
# $OUT/pool.log. GPUS="2 3" uses those GPUs only, and with TRACKER_PORT and
# PORT_BASE (server ports) of its own and `taskset` two chunks share a
# machine, e.g. on 4 GPUs and 64 cores (each its own OUT, WORKDIR, DB_ROOT):
#   OUT=$OUT/a WORKDIR=/tmp/wa DB_ROOT=/tmp/da POOL=1 GPUS="0 1" taskset -c 0-31 bash scripts/gpu_chunk.sh ... &
#   OUT=$OUT/b WORKDIR=/tmp/wb DB_ROOT=/tmp/db POOL=1 GPUS="2 3" TRACKER_PORT=9290 PORT_BASE=9300 \
#     CUDA_VISIBLE_DEVICES=2 taskset -c 32-63 bash scripts/gpu_chunk.sh ... ; wait
# (CUDA_VISIBLE_DEVICES: the GPU the run's own validation and latency use.)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_args.sh
refuse_env_args "$0" EXTRA "$@" || exit 2
source scripts/gpu_env.sh
POOL_ARGS=()
if [ "${POOL:-0}" != 0 ]; then
  list=${GPUS:-$(nvidia-smi -L | sed -n 's/^GPU \([0-9]*\):.*/\1/p' | tr '\n' ' ')}
  read -r -a gpus <<< "${list//,/ }"
  for gpu in "${gpus[@]}"; do
    [[ $gpu =~ ^[0-9]+$ ]] || { echo "error: GPUS must list GPU indices, e.g. \"0 1\" or 0,1 | got '$list'" >&2; exit 2; }
  done
  n=${#gpus[@]}
  [ "$n" -ge 1 ] || { echo "error: no GPU for the pool (nvidia-smi lists none, GPUS is empty)" >&2; exit 2; }
  tport=${TRACKER_PORT:-9190}
  pbase=${PORT_BASE:-9090}
  pids=()
  trap 'kill "${pids[@]}" 2>/dev/null' EXIT
  python3 -m deploy rpc-tracker --port "$tport" >> "$OUT/pool.log" 2>&1 & pids+=($!)
  for _ in $(seq 30); do python3 -c "import socket; socket.create_connection(('127.0.0.1', $tport), 1)" 2>/dev/null && break; sleep 1; done
  for i in $(seq 0 $((n - 1))); do
    python3 -m deploy rpc-server --tracker "127.0.0.1:$tport" --key local --gpu "${gpus[$i]}" --port $((pbase + 10 * i)) \
      --port-end $((pbase + 10 + 10 * i)) >> "$OUT/pool.log" 2>&1 & pids+=($!)
  done
  for _ in $(seq 60); do
    [ "$(python3 -m deploy rpc-status --tracker "127.0.0.1:$tport" --rpc-key local 2>/dev/null | grep -c '^server')" -ge "$n" ] && break
    sleep 1
  done
  POOL_ARGS=(TRACKER="127.0.0.1:$tport" RPC_KEY=local)
fi
# Leave time to pack the results before the device command's 10-minute limit.
# SIGNAL=KILL ends the chunk as a machine taken back would (the whole run
# killed outright): the tuning journal keeps every candidate measured.
timeout -k 60 --signal="${SIGNAL:-INT}" "${CHUNK_SECONDS:-520}" make tune PYTHON=python3 WORKDIR="$WORKDIR" UNTUNED=1 EXTRA="--db-root $DB_ROOT ${EXTRA:-}" "${POOL_ARGS[@]}" "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
# A run killed past its grace period leaves its records in a working copy and
# its journal: fold them in (and rebuild the kernel store).
python3 -m deploy pack-databases "$DB_ROOT" > "$OUT/pack.log" 2>&1
tar -czf "$OUT/tuning_logs.tgz" -C "$DB_ROOT" .
# The small, reviewable outputs: summaries, manifests, reports, failure reasons.
tar -czf "$OUT/reports.tgz" -C "$WORKDIR" --ignore-failed-read \
  summary.json package/manifest.json package/validation.json tune/summary.json tune/failures.jsonl \
  optimize/manifest.json 2>/dev/null
exit $rc
