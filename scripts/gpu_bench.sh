#!/usr/bin/env bash
# The latency table on the GPU machine: build the package from the committed
# tuning databases (no tuning: TRIALS=0), then `make bench` with the same
# variables; results (json, md, png) and logs land in $OUT.
#
#   bash scripts/gpu_bench.sh <make variables...>
#   e.g. bash scripts/gpu_bench.sh MODEL=resnet50 TARGET=cuda BUCKETS=1 PRECISION=fp16 RUNNERS=tvm,torch-compile ITERS=500
#        BENCH_EXTRA="--any --bench flags" bash scripts/gpu_bench.sh ...   (from the environment, not as an argument)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_args.sh
refuse_env_args "$0" BENCH_EXTRA "$@" || exit 2
source scripts/gpu_env.sh
build_package "$@" || exit $?
make bench PYTHON=python3 WORKDIR="$WORKDIR" EXTRA="--db-root $DB_ROOT --out $OUT/bench ${EXTRA:-} ${BENCH_EXTRA:-}" "$@" 2>&1 | tee "$OUT/bench.log"
exit "${PIPESTATUS[0]}"
