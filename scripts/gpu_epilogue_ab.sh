#!/usr/bin/env bash
# The wgmma kernel's epilogue staged through shared memory (the default) against stored as the registers
# hold it (passes/wgmma_epilogue.py), on the GPU machine after the bundle is staged:
#
#   bash scripts/gpu_epilogue_ab.sh [MODEL [BATCH]]      (by default resnet50 64)
#
# The GEMM probe on ResNet-50 b64's 1x1 shapes with their epilogue (bias, an fp16 residual, ReLU), both
# stores, beside cuBLAS ($OUT/probe-residual/); then MODEL's package built with each (`deploy run --trials
# 0`, validated; the two at once), benched (`deploy bench`, TVM alone, 50 iterations x 3 rounds) and
# profiled (`deploy profile`) one after the other: $OUT/ab-<store>-{run,bench,profile}.log, and the
# probe's and benches' folders in $OUT/epilogue-ab.tgz (the device tool brings back a few files only).
# Exit 1 where a probe row, build, validation, bench or profile failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
model=${1:-resnet50}
batch=${2:-64}
W=${WORK:-/tmp/epilogue-ab}
rc=0
python3 scripts/wgmma_gemm_probe.py --kernels persistent --epilogue residual --store staged,registers \
  --b-layout kn --shapes 200704x256x64,50176x512x128,12544x1024x256,3136x2048x512 \
  --out "$OUT/probe-residual" > "$OUT/probe-residual.log" 2>&1 || rc=1
grep -E "^\| " "$OUT/probe-residual/probe.md" | cut -c1-170
# deploy's command line with the kernel's epilogue set first (the build runs in this process)
with() {
  python3 -c "import sys; from deploy.passes import wgmma_gemm; wgmma_gemm.EPILOGUE = sys.argv[1]
from deploy.cli import main; sys.exit(main(sys.argv[2:]))" "$@"
}
common=(--target cuda --precision fp16 --buckets "$batch" --db-root "$DB_ROOT")
for st in staged registers; do
  with "$st" run --model "$model" "${common[@]}" --trials 0 --workdir "$W/$st" --alternatives none \
    > "$OUT/ab-$st-run.log" 2>&1 &
done
wait
for st in staged registers; do
  if ! grep -q "^validation PASSED" "$OUT/ab-$st-run.log"; then
    echo "$st: not benched: $(grep -E "^validation|error" "$OUT/ab-$st-run.log" | head -n 1)"; rc=1; continue
  fi
  with "$st" bench --model "$model" "${common[@]}" --workdir "$W/$st" --out "$OUT/ab-$st-bench" --runners tvm \
    --iters 50 --rounds 3 > "$OUT/ab-$st-bench.log" 2>&1 || rc=1
  grep -E "^\| tvm" "$OUT/ab-$st-bench/results.md" | sed "s/^/$st: /"
  with "$st" profile -m "$model" "${common[@]}" --bucket "$batch" --workdir "$W/$st" > "$OUT/ab-$st-profile.log" 2>&1 \
    || rc=1
  head -n 1 "$OUT/ab-$st-profile.log" | cut -c1-110 | sed "s/^/$st: /"
done
(cd "$OUT" && tar czf epilogue-ab.tgz probe-residual ab-*-bench 2>/dev/null && rm -rf probe-residual ab-*-bench)
exit "$rc"
