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
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
# Leave time to pack the results before the device command's 10-minute limit.
timeout -k 30 --signal=INT "${CHUNK_SECONDS:-540}" make tune PYTHON=python3 WORKDIR="$WORKDIR" EXTRA="--db-root $DB_ROOT ${EXTRA:-}" "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
# A run killed past its grace period leaves its records in a working copy: fold it in.
python3 -m deploy pack-databases "$DB_ROOT" > /dev/null
tar -czf "$OUT/tuning_logs.tgz" -C "$DB_ROOT" .
# The small, reviewable outputs: summaries, manifests, reports, failure reasons.
tar -czf "$OUT/reports.tgz" -C "$WORKDIR" --ignore-failed-read \
  summary.json package/manifest.json package/validation.json tune/summary.json tune/failures.jsonl \
  optimize/manifest.json 2>/dev/null
exit $rc
