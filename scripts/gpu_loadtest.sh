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
for a in "$@"; do
  case "$a" in LOADTEST_EXTRA=*|EXTRA=*) echo "error: $a is read from the environment, not as an argument | got it after the script's name | expected: LOADTEST_EXTRA=\"...\" bash $0 MODEL=..." >&2; exit 2;; esac
done
source scripts/gpu_env.sh
build_package "$@" || exit $?
make loadtest PYTHON=python3 WORKDIR="$WORKDIR" OUT="$OUT/loadtest" EXTRA="${LOADTEST_EXTRA:-}" "$@" 2>&1 | tee "$OUT/loadtest.log"
exit "${PIPESTATUS[0]}"
