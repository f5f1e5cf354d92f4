#!/usr/bin/env bash
# passes/pipeline_sync.py on the GPU machine (the `device` tool's H200 or
# H100): our `mma.sync` GEMMs and ResNet-50's implicit-GEMM convolutions
# with one barrier a K step (the package's) against two (as TVM 0.27 lowers
# them), each checked against PyTorch and timed beside cuBLAS/cuDNN; the
# `-m gpu` tests of those kernels, which build them the package's way; and a
# model's package from the committed databases built both ways
# (DEPLOY_PIPELINE_SYNC=stock for TVM's), `deploy bench` of each.
#
#   bash scripts/gpu_pipeline_sync.sh [tests|probe|package|all]
#   MODEL=resnet50 BATCH=64 EXTRA=--implicit-gemm (the package pass's defaults)
#
# Writes $OUT/pytest-gpu.log, $OUT/gemm (mma_gemm_probe.py, bias epilogue),
# $OUT/conv (implicit_gemm_probe.py), $OUT/package.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
case "$what" in tests|probe|package|all) ;; *)
  echo "error: unknown pass '$what' | expected: tests, probe, package or all" >&2; exit 2;; esac
source scripts/gpu_env.sh
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m gpu tests/passes/test_mma_gemm.py tests/passes/test_implicit_gemm.py tests/passes/test_tf32.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$what" = probe ] || [ "$what" = all ]; then
  python3 scripts/mma_gemm_probe.py --barriers both --epilogue bias \
    --shapes "${SHAPES:-4096x4096x4096,6400x1536x384,6400x384x1536}" \
    --configs "${CONFIGS:-128x128x32-w2x2-s4,128x128x64-w2x2-s3,128x96x32-w4x1-s4}" \
    --out "$OUT/gemm" 2>&1 | grep -v "Fast mode segfaults" > "$OUT/gemm.log" || rc=1
  cat "$OUT/gemm/probe.md"
  python3 scripts/implicit_gemm_probe.py --barriers both \
    --convs "${CONVS:-64x56x56x64-64-3-s1,64x28x28x128-128-3-s1,64x14x14x256-256-3-s1}" \
    --configs "${CONV_CONFIGS:-128x128x64-w2x2-s3,128x64x32-w2x2-s4}" \
    --out "$OUT/conv" 2>&1 | grep -v "Fast mode segfaults" > "$OUT/conv.log" || rc=1
  cat "$OUT/conv/probe.md"
fi
if [ "$what" = package ] || [ "$what" = all ]; then
  P=/tmp/pipeline-sync; mkdir -p "$P"
  m=${MODEL:-resnet50}; b=${BATCH:-64}
  for v in stock one; do
    W=/tmp/ws-sync-$m-$b-$v; runners=tvm; [ "$v" = one ] && runners=tvm,torch-compile
    export DEPLOY_PIPELINE_SYNC=$v
    s=$(date +%s)
    python3 -m deploy run --model "$m" --target cuda --precision fp16 --buckets "$b" --trials 0 \
      --db-root "$DB_ROOT" --workdir "$W" --alternatives none ${EXTRA---implicit-gemm} 2>&1 \
      | grep -v "Fast mode segfaults" > "$P/$m-$v-run.log" || rc=1
    echo "run: $(( $(date +%s) - s )) s" >> "$P/$m-$v-run.log"
    python3 -m deploy bench --model "$m" --target cuda --precision fp16 --buckets "$b" --workdir "$W" \
      --db-root "$DB_ROOT" --compile-mode default --out "$P/$m-$v-bench" --runners "$runners" \
      --iters 100 --rounds 3 ${EXTRA---implicit-gemm} > "$P/$m-$v-bench.log" 2>&1 || rc=1
    tail -n 8 "$P/$m-$v-bench.log"
    tar czf "$OUT/package.tgz" -C /tmp pipeline-sync
  done
  unset DEPLOY_PIPELINE_SYNC
fi
exit "$rc"
