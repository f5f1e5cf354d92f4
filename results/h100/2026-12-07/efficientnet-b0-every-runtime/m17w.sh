#!/usr/bin/env bash
# m17.sh with torch.compile's max-autotune compiled while make tune runs: a
# second process (its own workdir, the same CLI bench) fills Inductor's cache,
# and the real bench finds its graphs there. $OUT gets one archive a run, with
# the model's databases as the run left them (the kernel check's verdicts). bash .device/jobs/m17w.sh MODEL BATCH
set -uo pipefail
source scripts/gpu_env.sh
M=$1; B=$2; RUN=${3:-tvm,tvm-untuned,torch-eager-fp16,torch-compile,onnxruntime-fp16}
R=/tmp/r/$M-b$B; mkdir -p $R; W=/tmp/w-$M-b$B; W2=/tmp/warm-$M-b$B; t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt 2>&1
python3 -c "import onnxruntime as o, torch; print(o.__version__, o.get_available_providers(), torch.__version__)" > $R/ort.txt 2>&1
( timeout 420 python3 -m deploy export -m $M --target cuda --precision fp16 --buckets $B --workdir $W2 \
  && timeout 420 python3 -m deploy bench -m $M --target cuda --precision fp16 --buckets $B --workdir $W2 \
     --runners torch-compile --iters 1 --rounds 1 --out $W2/bench; echo "warm rc $? $((SECONDS-t0))s" ) > $R/warm.log 2>&1 &
WP=$!
timeout 260 make tune PYTHON=python3 WORKDIR=$W TRIALS=0 UNTUNED=1 MODEL=$M TARGET=cuda PRECISION=fp16 BUCKETS=$B \
  EXTRA="--db-root $DB_ROOT --alternatives none" > $R/run.log 2>&1; echo "$M b$B run rc $? $((SECONDS-t0))s"; tail -6 $R/run.log
cp -r $DB_ROOT/$M $R/db 2>/dev/null; tar czf $OUT/$M-b$B.tgz -C /tmp/r $M-b$B
wait $WP; echo "warm done $((SECONDS-t0))s"; tail -3 $R/warm.log
timeout $((575-SECONDS+t0)) make bench PYTHON=python3 WORKDIR=$W MODEL=$M TARGET=cuda PRECISION=fp16 BUCKETS=$B \
  RUNNERS=$RUN ITERS=100 ROUNDS=3 EXTRA="--db-root $DB_ROOT --out $R/bench" > $R/bench.log 2>&1
echo "$M b$B bench rc $? $((SECONDS-t0))s"; grep -E "^\| |PASSED|FAILED|error" $R/bench.log | tail -12
tar czf $OUT/$M-b$B.tgz -C /tmp/r $M-b$B
