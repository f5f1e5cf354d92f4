#!/usr/bin/env bash
# `--wgmma-gemm` (deploy/passes/wgmma_gemm.py) on the GPU machine (the
# `device` tool's Hopper GPU), in one call after the bundle is staged.
#
#   bash scripts/gpu_wgmma.sh tests            the pass's and the GEMM probe's -m gpu tests ($OUT/pytest-gpu.log)
#   bash scripts/gpu_wgmma.sh bench vit,bert   (BATCH=32) each model's package from the committed databases
#        built without (--no-wgmma-gemm) and with it (--wgmma-gemm: implicit GEMMs too) at once (`deploy run
#        --trials 0`, validated), then `deploy bench` of each that built and validated (the flag's
#        beside torch.compile and eager fp16; RUNNERS= to change), 50 iterations, 3 rounds; logs and
#        results in $OUT/wgmma-bench.tgz after each model; exit 1 where any test, build, validation or bench failed;
#        EXTRA= more flags for every build and bench (e.g. EXTRA="--implicit-gemm --flat-gemm": convolutions
#        as GEMMs, which the kernel then takes too); VARIANTS="off default on" adds a third package built
#        with neither flag (the default: since ec66855 the same kernels as --wgmma-gemm in fp16; before, GEMMs
#        only, not implicit GEMMs' gathers); "plain" one with --no-implicit-gemm (the kernel takes GEMMs, the
#        convolutions stay convolutions: the graph the committed databases were tuned for); PROFILE=1: then
#        `deploy profile` of each benched package (the per-kernel report: $B/<model>-<variant>-profile.log)
#   bash scripts/gpu_wgmma.sh both vit,bert    tests, then bench
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-both}
models=${2:-vit,bert,convnext}
case "$what" in tests|bench|both) ;; *)
  echo "error: unknown pass '$what' | expected: tests, bench or both" >&2; exit 2;; esac
read -r -a variants <<< "${VARIANTS:-off on}"
for v in "${variants[@]-}"; do
  case "$v" in off|default|on|plain) ;; *)
    echo "error: unknown variant '$v' in VARIANTS | expected: off, default, on or plain" >&2; exit 2;; esac
done
if [ "$(printf '%s\n' "${variants[@]}" | sort -u | wc -l)" != "${#variants[@]}" ]; then
  echo "error: VARIANTS='${VARIANTS}' names a variant twice | each of off, default, on, plain at most once" >&2; exit 2
fi
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
# the variant's flags: --no-wgmma-gemm, none (the default) or --wgmma-gemm, then EXTRA; plain: EXTRA, then
# --no-implicit-gemm
flags() {
  case "$1" in off) echo "--no-wgmma-gemm ${EXTRA-}";; on) echo "--wgmma-gemm ${EXTRA-}";;
    plain) echo "${EXTRA-} --no-implicit-gemm";; *) echo "${EXTRA-}";; esac  # (plain's last: it wins over EXTRA's)
}
for m in ${models//,/ }; do
  pids=()
  for v in "${variants[@]}"; do  # (the packages built at once: each build is mostly single-threaded)
    read -r -a flag <<< "$(flags "$v")"
    (s=$(date +%s)
     python3 -m deploy run --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" --trials 0 \
       --db-root "$DB_ROOT" --workdir "$WORK/ws-$m-$v" --alternatives none ${flag[@]+"${flag[@]}"} 2>&1 \
       | grep -v "Fast mode segfaults" > "$B/$m-$v-run.log"
     status=${PIPESTATUS[0]}
     echo "rc=$status $(( $(date +%s) - s )) s" >> "$B/$m-$v-run.log"
     exit "$status") &
    pids+=($!)
  done
  built=()
  for i in "${!variants[@]}"; do  # (a failed or unvalidated build is not benched: its workdir may hold an older package)
    v=${variants[$i]}
    if wait "${pids[$i]}" && ! grep -q "^validation FAILED" "$B/$m-$v-run.log"; then built+=("$v"); else rc=1; fi
    grep -E "wgmma-gemm|^validation|^rc=" "$B/$m-$v-run.log" | sed "s/^/$m $v: /" | cut -c1-220
  done
  # (the builds' own latency lines are not printed: the builds timed them side by side on one GPU)
  for v in on off default plain; do  # (on first: it benches the other runners too)
    [[ " ${variants[*]} " == *" $v "* ]] || continue
    [[ " ${built[*]-} " == *" $v "* ]] || { echo "$m $v: not benched (its build failed)"; continue; }
    read -r -a flag <<< "$(flags "$v")"
    runners=tvm; [ "$v" = on ] && runners=${RUNNERS:-tvm,torch-compile,torch-eager-fp16}
    rm -rf "$B/$m-$v-bench"
    python3 -m deploy bench --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" \
      --workdir "$WORK/ws-$m-$v" --db-root "$DB_ROOT" --compile-mode default --out "$B/$m-$v-bench" \
      --runners "$runners" --iters 50 --rounds 3 ${flag[@]+"${flag[@]}"} > "$B/$m-$v-bench.log" 2>&1 || rc=1
    if [ -f "$B/$m-$v-bench/results.md" ]; then
      grep -E "^\| (tvm|torch)" "$B/$m-$v-bench/results.md" | sed "s/^/$m $v: /"
    else
      tail -n 3 "$B/$m-$v-bench.log"
    fi
    if [ "${PROFILE:-0}" = 1 ]; then  # (each kernel timed alone: its share, TFLOP/s and GB/s against the GPU's peaks)
      python3 -m deploy profile -m "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" --bucket "${BATCH:-32}" \
        --db-root "$DB_ROOT" --workdir "$WORK/ws-$m-$v" ${flag[@]+"${flag[@]}"} > "$B/$m-$v-profile.log" 2>&1 || rc=1
      head -n 1 "$B/$m-$v-profile.log" | cut -c1-160 | sed "s/^/$m $v: /"
    fi
  done
  tar czf "$OUT/wgmma-bench.tgz" -C "$WORK" bench
done
exit "$rc"
