#!/usr/bin/env bash
# `--wgmma-gemm` (deploy/passes/wgmma_gemm.py) on the GPU machine (the
# `device` tool's Hopper GPU), in one call after the bundle is staged.
#
#   bash scripts/gpu_wgmma.sh tests            the pass's and the GEMM probe's -m gpu tests ($OUT/pytest-gpu.log)
#   bash scripts/gpu_wgmma.sh bench vit,bert   (BATCH=32) each model's package from the committed databases
#        built without and with the flag at once (`deploy run --trials 0`, validated), then `deploy bench`
#        of each (the flag's beside torch.compile and eager fp16; RUNNERS= to change), 50 iterations,
#        3 rounds; logs and results in $OUT/wgmma-bench.tgz after each model
#   bash scripts/gpu_wgmma.sh both vit,bert    tests, then bench
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-both}
models=${2:-vit,bert,convnext}
case "$what" in tests|bench|both) ;; *)
  echo "error: unknown pass '$what' | expected: tests, bench or both" >&2; exit 2;; esac
source scripts/gpu_env.sh
WORK=${WORK:-/tmp/wgmma}
mkdir -p "$WORK"
rc=0
if [ "$what" != bench ]; then
  python3 -m pytest -q -m gpu tests/passes/test_wgmma_gemm.py tests/test_wgmma_probe.py -p no:cacheprovider \
    > "$OUT/pytest-gpu.log" 2>&1 || rc=1
  tail -n 3 "$OUT/pytest-gpu.log"
fi
[ "$what" = tests ] && exit "$rc"
B=$WORK/bench
mkdir -p "$B"
for m in ${models//,/ }; do
  for v in off on; do  # (both packages built at once: each build is mostly single-threaded)
    flag=(); [ "$v" = on ] && flag=(--wgmma-gemm)
    (s=$(date +%s)
     python3 -m deploy run --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" --trials 0 \
       --db-root "$DB_ROOT" --workdir "$WORK/ws-$m-$v" --alternatives none "${flag[@]}" 2>&1 \
       | grep -v "Fast mode segfaults" > "$B/$m-$v-run.log"
     echo "rc=${PIPESTATUS[0]} $(( $(date +%s) - s )) s" >> "$B/$m-$v-run.log") &
  done
  wait
  for v in on off; do
    flag=(); [ "$v" = on ] && flag=(--wgmma-gemm)
    runners=tvm; [ "$v" = on ] && runners=${RUNNERS:-tvm,torch-compile,torch-eager-fp16}
    grep -E "wgmma-gemm|^bucket|^validation|^rc=" "$B/$m-$v-run.log" | cut -c1-220
    python3 -m deploy bench --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" \
      --workdir "$WORK/ws-$m-$v" --db-root "$DB_ROOT" --compile-mode default --out "$B/$m-$v-bench" \
      --runners "$runners" --iters 50 --rounds 3 "${flag[@]}" > "$B/$m-$v-bench.log" 2>&1 || rc=1
    grep -E "^\| (tvm|torch)" "$B/$m-$v-bench/results.md" 2>/dev/null || tail -n 3 "$B/$m-$v-bench.log"
  done
  tar czf "$OUT/wgmma-bench.tgz" -C "$WORK" bench
done
exit "$rc"
