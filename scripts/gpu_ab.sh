#!/usr/bin/env bash
# One model's package built several ways from the same code, each with some of our passes' module
# constants set (deploy.passes.<module>.<NAME>), then validated, benched and profiled, on the GPU machine
# after the bundle is staged:
#
#   bash scripts/gpu_ab.sh MODEL BATCH LABEL:SETTINGS [LABEL:SETTINGS ...]
#   bash scripts/gpu_ab.sh resnet50 64 new: "no-stem:implicit_gemm.FEW_CHANNELS=0" \
#        "sixteen:wgmma_gemm.MULTIPLE=16,implicit_gemm.FEW_CHANNELS=0"
#
# SETTINGS: comma-separated module.NAME=value (a Python literal; empty: the code as it is; scripts/
# with_settings.py sets them), or deploy's own flags without a value (`direct:--no-implicit-gemm`). The packages are
# built one after the other (`deploy run --trials 0`, validated: where the databases hold records the build
# times them against the default schedules on the GPU and keeps its choices in DB_ROOT, so builds at once
# would disturb each other's timings and choices; PARALLEL=1 builds them at once, each mostly one thread),
# then benched (`deploy bench`, TVM alone, 50 iterations x 3 rounds) and profiled (`deploy profile`), in
# fp16 or PRECISION (PRECISION=fp32 bash scripts/gpu_ab.sh resnet50 64 ...):
# $OUT/ab-<label>-{run,bench,profile}.log, the benches' folders in $OUT/ab.tgz (the device tool brings back
# a few files only). Exit 1 where a build, validation, bench or profile failed; 2 on a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
  echo "error: expected MODEL BATCH LABEL:SETTINGS... | e.g. resnet50 64 new: no-stem:implicit_gemm.FEW_CHANNELS=0" >&2
  exit 2
fi
model=$1
batch=$2
shift 2
labels=()
for v in "$@"; do
  label=${v%%:*}
  if [[ "$v" != *:* || ! "$label" =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "error: variant '$v' is not LABEL:SETTINGS | a label of letters, digits, - and _, then ':'" >&2; exit 2
  fi
  if [[ " ${labels[*]-} " == *" $label "* ]]; then
    echo "error: label '$label' given twice | one variant a label" >&2; exit 2
  fi
  labels+=("$label")
done
source scripts/gpu_env.sh
W=${WORK:-/tmp/ab}
rc=0
# deploy's command line with the settings made first (the build runs in that process)
with() { python3 scripts/with_settings.py "$@"; }
common=(--target cuda --precision "${PRECISION:-fp16}" --buckets "$batch" --db-root "$DB_ROOT")
pids=()
for v in "$@"; do
  label=${v%%:*}
  with "${v#*:}" run --model "$model" "${common[@]}" --trials 0 --workdir "$W/$label" --alternatives none \
    > "$OUT/ab-$label-run.log" 2>&1 &
  pids+=($!)
  [ "${PARALLEL:-0}" = 1 ] || { wait "$!" || rc=1; pids=(); }
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for v in "$@"; do
  label=${v%%:*}
  if ! grep -q "^validation PASSED" "$OUT/ab-$label-run.log"; then
    echo "$label: not benched: $(grep -E "^validation|rror" "$OUT/ab-$label-run.log" | head -n 1 | cut -c1-200)"
    rc=1; continue
  fi
  grep -E "schedules" "$OUT/ab-$label-run.log" | head -n 1 | sed "s/.*(schedules/(schedules/" | sed "s/^/$label: /"
  with "${v#*:}" bench --model "$model" "${common[@]}" --workdir "$W/$label" --out "$OUT/ab-$label-bench" \
    --runners tvm --iters 50 --rounds 3 > "$OUT/ab-$label-bench.log" 2>&1 || rc=1
  grep -E "^\| tvm" "$OUT/ab-$label-bench/results.md" | sed "s/^/$label: /"
  with "${v#*:}" profile -m "$model" "${common[@]}" --bucket "$batch" --workdir "$W/$label" \
    > "$OUT/ab-$label-profile.log" 2>&1 || rc=1
  head -n 1 "$OUT/ab-$label-profile.log" | cut -c1-110 | sed "s/^/$label: /"
done
(cd "$OUT" && tar czf ab.tgz ab-*-bench 2>/dev/null && rm -rf ab-*-bench)
exit "$rc"
