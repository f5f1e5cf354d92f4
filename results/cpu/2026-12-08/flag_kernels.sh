#!/usr/bin/env bash
# bash results/cpu/2026-12-08/flag_kernels.sh FLAG [WORK]: for every corpus model's optimized module
# (WORK/<model>-fp32/optimize/b1.relax.json, default /tmp/fin2/work: the corpus run of 2026-12-07 evening),
# each kernel whose llvm schedule cpu_default.FLAG changes, built with FLAG off (old) and on (new), timed in
# turns (9 rounds) and its outputs compared (results/cpu/2026-12-07/whole-blocks/kernels_ab.py).
flag=$1; work=${2:-/tmp/fin2/work}
cd "$(dirname "$0")/../../.."
for d in "$work"/*-fp32; do
  echo "== $(basename "$d" -fp32)"
  ONLYDIFF=1 TURNS=1 PYTHONPATH=. timeout 900 .venv/bin/python results/cpu/2026-12-07/whole-blocks/kernels_ab.py \
    "$d/optimize/b1.relax.json" "." "old:cpu_default.$flag=False" new: 2>&1 | grep -v -i warn | grep -E "old=|rror|Traceback"
done
