#!/usr/bin/env bash
# ONNX Runtime with its CUDA execution provider (onnxruntime-gpu, a ~256 MB
# wheel) for the GPU machine, whose image has only the CPU build: split into
# parts that each travel with one device call, as the TVM bundle does.
#
#   bash scripts/ort_gpu_parts.sh            (from the project root; PARTS=5 by default)
#
# writes .device/ort-part1/ ... .device/ort-partN/ (ignored through .git/info/exclude).
# On the GPU machine, one part per call, in a row (the machine is kept only
# ~30 s between calls), before or after the TVM bundle's parts:
#   with .device/ort-part1:  bash .device/ort-part1/stage.sh
#   ...
#   with .device/ort-partN:  bash .device/ort-partN/stage.sh && source scripts/gpu_env.sh && <command>
# It installs into the TVM bundle's folder (/tmp/device-bundle/site), which
# scripts/gpu_env.sh puts ahead of the image's packages, so `import onnxruntime`
# then finds this build. Its other needs (numpy, protobuf, flatbuffers, the
# nvidia-* CUDA 13 libraries it loads through onnxruntime.preload_dlls()) are
# in the image. The bench's runners `onnxruntime` and `onnxruntime-fp16` then
# run on its CUDA provider (docs/bench.md).
set -euo pipefail
spec=${ORT_GPU:-onnxruntime-gpu==1.31.0}
n=${PARTS:-5}
out=.device
mkdir -p "$out"
exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=""; for v in 17 27 28 34; do plat="$plat --platform manylinux_2_${v}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  --platform manylinux2014_x86_64 -d "$tmp/whl" "$spec"
whl=$(ls "$tmp"/whl/*.whl)
name=$(basename "$whl")
sum=$(sha256sum "$whl" | cut -d' ' -f1)
rm -rf "$out"/ort-part*
split -n "$n" -d -a 2 "$whl" "$tmp/chunk."
for i in $(seq 1 "$n"); do
  d="$out/ort-part$i"; mkdir -p "$d"
  mv "$tmp/chunk.$(printf %02d $((i-1)))" "$d/chunk"
  cat > "$d/stage.sh" <<STAGE
#!/usr/bin/env bash
# Runs on the GPU machine: keep this part of $name; once all $n are there, install it.
set -euo pipefail
b=/tmp/ort-gpu-${sum:0:16}; mkdir -p \$b  # (named by the wheel: parts of another run never mix in)
cp "\$(dirname "\$0")/chunk" \$b/chunk.$i
have=\$(ls \$b/chunk.* 2>/dev/null | wc -l)
if [ "\$have" -eq $n ]; then
  for j in \$(seq 1 $n); do cat \$b/chunk.\$j; done > \$b/$name
  echo "$sum  \$b/$name" | sha256sum -c --quiet || { echo "onnxruntime-gpu checksum mismatch: the parts come from different runs" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/device-bundle/site \$b/$name
  rm -rf \$b
  [ -f /tmp/device-bundle/env.sh ] || echo 'export PYTHONPATH=/tmp/device-bundle/site\${PYTHONPATH:+:\$PYTHONPATH}' > /tmp/device-bundle/env.sh
  echo "onnxruntime-gpu installed in /tmp/device-bundle/site: source scripts/gpu_env.sh"
else
  echo "onnxruntime-gpu part $i of $n staged (\$have so far); stage the others in the next calls, each within ~30 s"
fi
STAGE
done
echo "onnxruntime-gpu: $(du -sh "$whl" | cut -f1) in $n parts under $out/ort-part*/ ($spec)"
