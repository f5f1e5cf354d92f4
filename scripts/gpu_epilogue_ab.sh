#!/usr/bin/env bash
# The wgmma kernel's epilogue staged through shared memory (the default) against stored as the registers
# hold it (passes/wgmma_epilogue.py), on the GPU machine after the bundle is staged:
#
#   bash scripts/gpu_epilogue_ab.sh [MODEL [BATCH]]      (by default resnet50 64)
#
# The GEMM probe on ResNet-50 b64's 1x1 shapes with their epilogue (bias, an fp16 residual, ReLU), both
# stores, beside cuBLAS ($OUT/probe-residual.log, its folder in $OUT/probe-residual.tgz); then MODEL's
# package built with each, validated, benched and profiled (scripts/gpu_ab.sh: $OUT/ab-staged-*,
# $OUT/ab-registers-*). Exit 1 where a probe row or gpu_ab.sh failed.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
rc=0
python3 scripts/wgmma_gemm_probe.py --kernels persistent --epilogue residual --store staged,registers \
  --b-layout kn --shapes 200704x256x64,50176x512x128,12544x1024x256,3136x2048x512 \
  --out "$OUT/probe-residual" > "$OUT/probe-residual.log" 2>&1 || rc=1
grep -E "^\| " "$OUT/probe-residual/probe.md" | cut -c1-170
(cd "$OUT" && tar czf probe-residual.tgz probe-residual && rm -rf probe-residual)
bash scripts/gpu_ab.sh "${1:-resnet50}" "${2:-64}" staged: "registers:wgmma_gemm.EPILOGUE='registers'" || rc=1
exit "$rc"
