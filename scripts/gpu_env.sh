# Sourced by the scripts that run on the GPU machine (the `device` tool's H200):
# TVM from the staged bundle, torch/onnx/onnxruntime from the image, this
# checkout on the path, NVRTC pointed at the CUDA toolkit.
[ -f /tmp/device-bundle/env.sh ] && source /tmp/device-bundle/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
for c in /usr/local/cuda /usr/local/cuda-13.0 /usr/local/cuda-13; do
  [ -z "${CUDA_PATH:-}" ] && [ -d "$c/include" ] && export CUDA_PATH=$c
done
OUT=${OUT:-/tmp/out}
WORKDIR=${WORKDIR:-/tmp/ws}
DB_ROOT=${DB_ROOT:-/tmp/tuning_logs}
mkdir -p "$OUT" "$DB_ROOT"
# Databases live in $DB_ROOT while the machine stays warm; seeded from the
# committed ones (a newer copy from an earlier chunk is kept).
cp -rn tuning_logs/. "$DB_ROOT"/ 2>/dev/null || true

# The package from the committed databases, without tuning (TRIALS=0; EXTRA
# from the environment adds CLI flags, e.g. EXTRA="--split-k 4"):
#   build_package <make variables...>
build_package() {
  make tune PYTHON=python3 WORKDIR="$WORKDIR" TRIALS=0 EXTRA="--db-root $DB_ROOT ${EXTRA:-}" "$@" 2>&1 | tee "$OUT/build.log"
  return "${PIPESTATUS[0]}"
}
