#!/usr/bin/env bash
# Tuning through TVM's RPC tracker on the GPU machine (the `device` tool's
# H200s), against tuning on the local GPU, in one run on loopback:
# scripts/rpc_check.py starts a tracker on 127.0.0.1, one RPC server per
# visible GPU (CUDA_VISIBLE_DEVICES per server, key `all`) and one more on
# GPU 0 (key `one`), tunes the same tasks from empty databases locally, on
# one server and on all of them (trials/min of each), then times each task's
# best kernel alternately locally and through RPC (they should agree within
# noise). Results: $OUT/rpc_check.md and .json, server logs in $OUT/logs.
#
#   bash scripts/gpu_rpc_check.sh [--model resnet50 --trials 256 --max-tasks 4 --modes one,one-lanes,all]
#
# TVM comes from the staged bundle (see README "On the GPU machine"); the
# tracker needs tornado, which must be in the bundle too.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
PY=${PYTHON:-python3}
"$PY" -c "import tornado" 2>/dev/null || { echo "error: tornado is missing (TVM's RPC tracker needs it): add tornado==6.6.1 to the device bundle" >&2; exit 2; }
nvidia-smi -L 2>/dev/null | tee "$OUT/gpus.txt"
# Stop before the device command's 10-minute limit; the script stops its tracker and servers however it ends.
timeout -k 30 --signal=INT "${CHUNK_SECONDS:-540}" "$PY" scripts/rpc_check.py --target cuda --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
# Only the small outputs come back: databases of the three modes are throw-away.
rm -rf "$OUT/ws" "$OUT"/db-* "$OUT"/tune-*
exit $rc
