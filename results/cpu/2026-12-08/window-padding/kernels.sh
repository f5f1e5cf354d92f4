#!/usr/bin/env bash
cd /work/main
for d in /tmp/fin2/work/*-fp32; do
  m=$(basename $d -fp32)
  echo "== $m"
  ONLYDIFF=1 TURNS=1 PYTHONPATH=. timeout 900 .venv/bin/python results/cpu/2026-12-07/whole-blocks/kernels_ab.py $d/optimize/b1.relax.json "." old:cpu_default.WINDOW_PADDING=False new: 2>&1 | grep -v -i warn | grep -E "old=|rror|Traceback"
done
