#!/usr/bin/env bash
# The fused attention kernel across the corpus's transformers on the GPU
# machine (the `device` tool's H200): each model built at full size,
# untuned, validated and timed (`scripts/corpus.py --iters`), with
# `--no-fused-attention` and `--fused-attention` (the default). Resumable: the corpus keeps its results in
# $WORK/corpus-{off,on} while the machine stays warm, and a second call
# times only what the first did not finish; both folders are copied to
# $OUT after each pass.
#
#   bash scripts/gpu_attention.sh [off|on|both] [MODELS]
#   e.g. bash scripts/gpu_attention.sh both vit,bert,gpt,swin_tiny_window,mobilevit_like,tiny_vit
#        bash scripts/gpu_attention.sh tests      (the kernel's -m gpu tests only)
#        bash scripts/gpu_attention.sh probe      (scripts/attention_probe.py: its schedule variants, in $OUT/probe)
#        bash scripts/gpu_attention.sh bench vit,bert   (BATCH=32: each model's package from the committed
#             databases without and with the flag, `deploy bench` of each beside torch.compile and eager
#             fp16, 100 iterations, 3 rounds: $OUT/bench.tgz; VARIANTS=on: the flag's package only)
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-both}
models=${2:-vit,bert,gpt,swin_tiny_window,mobilevit_like,tiny_vit}
case "$what" in off|on|both|tests|probe|bench) ;; *)
  echo "error: unknown pass '$what' | expected: off, on, both, tests, probe or bench" >&2; exit 2;; esac
source scripts/gpu_env.sh
WORK=${WORK:-/tmp/attention}
mkdir -p "$WORK"
if [ "$what" = tests ]; then
  python3 -m pytest -q -m gpu tests/passes/test_attention.py tests/passes/test_shared_limit.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest-gpu.log"
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = probe ]; then
  python3 scripts/attention_probe.py --out "$OUT/probe" 2>&1 | grep -v "Fast mode segfaults" | tee "$OUT/probe.log"
  exit "${PIPESTATUS[0]}"
fi
rc=0
if [ "$what" = bench ]; then
  B=$WORK/bench; mkdir -p "$B"
  for m in ${models//,/ }; do
    for v in ${VARIANTS:-off on}; do
      flag=(--no-fused-attention); [ "$v" = on ] && flag=(--fused-attention)
      runners=tvm; [ "$v" = on ] && runners=tvm,torch-compile,torch-eager-fp16
      W=$WORK/ws-$m-b${BATCH:-32}-$v; s=$(date +%s)
      python3 -m deploy run --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" --trials 0 \
        --db-root "$DB_ROOT" --workdir "$W" --alternatives none "${flag[@]}" 2>&1 \
        | grep -v "Fast mode segfaults" > "$B/$m-$v-run.log" || rc=1
      echo "run: $(( $(date +%s) - s )) s" >> "$B/$m-$v-run.log"
      python3 -m deploy bench --model "$m" --target cuda --precision fp16 --buckets "${BATCH:-32}" --workdir "$W" \
        --db-root "$DB_ROOT" --compile-mode default --out "$B/$m-$v-bench" --runners "$runners" \
        --iters 100 --rounds 3 "${flag[@]}" > "$B/$m-$v-bench.log" 2>&1 || rc=1
      tail -n 12 "$B/$m-$v-bench.log"
      tar czf "$OUT/bench.tgz" -C "$WORK" bench
    done
  done
  exit "$rc"
fi
for v in off on; do
  [ "$what" = both ] || [ "$what" = "$v" ] || continue
  flag=(--no-fused-attention); [ "$v" = on ] && flag=(--fused-attention)
  python3 scripts/corpus.py --target cuda --size full --models "$models" --iters 100 \
    --out "$WORK/corpus-$v" --work "$WORK/work-$v" "${flag[@]}" > "$WORK/corpus-$v.log" 2>&1 || rc=$?
  mkdir -p "$OUT/corpus-$v"
  cp "$WORK/corpus-$v"/corpus.json "$WORK/corpus-$v"/corpus.md "$OUT/corpus-$v/" 2>/dev/null
  grep -v "Fast mode segfaults" "$WORK/corpus-$v.log" > "$OUT/corpus-$v/corpus.log"
done
exit "$rc"
