#!/usr/bin/env bash
# untuned packages of the depthwise models, built by the committed code (old) and the working tree (new)
for m in mobilenet_v2 mobilenet_v3 efficientnet_b0 shufflenet_v2 mobilevit_like; do
  (cd /tmp/wpold && /work/main/.venv/bin/python -m deploy run -m $m --target llvm --buckets 1 --trials 0 --db-root /tmp/empty --workdir /tmp/wpo/$m-fp32 --alternatives none 2>&1 | grep -E "^validation|error")
  (cd /work/main && /work/main/.venv/bin/python -m deploy run -m $m --target llvm --buckets 1 --trials 0 --db-root /tmp/empty --workdir /tmp/wpn/$m-fp32 --alternatives none 2>&1 | grep -E "^validation|error")
done
