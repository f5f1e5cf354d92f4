#!/usr/bin/env bash
# The serving load test on the GPU machine: build the package from the
# committed tuning databases (no tuning: TRIALS=0), then `make loadtest` with
# the same variables; the report and logs land in $OUT. The bundle must carry
# the serving wheels (scripts/device-wheels.txt).
#
#   bash scripts/gpu_loadtest.sh <make variables...>
#   e.g. bash scripts/gpu_loadtest.sh MODEL=resnet50 TARGET=cuda BUCKETS=1,8,32,64
#        LOADTEST_EXTRA="--request-batch 8" bash scripts/gpu_loadtest.sh ...
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_args.sh
refuse_env_args "$0" LOADTEST_EXTRA "$@" || exit 2
source scripts/gpu_env.sh
build_package "$@" || exit $?
make loadtest PYTHON=python3 WORKDIR="$WORKDIR" OUT="$OUT/loadtest" EXTRA="${LOADTEST_EXTRA:-}" "$@" 2>&1 | tee "$OUT/loadtest.log"
exit "${PIPESTATUS[0]}"
