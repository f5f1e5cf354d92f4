source .venv/bin/activate
mkdir -p /tmp/b32pad
for m in convnext bert mlp_mixer swin_tiny_window mobilevit_like gpt efficientnet_b0 resnet50; do
  w=/tmp/b32pad/$m; rm -rf $w
  for s in export frontend optimize build; do python -m deploy $s -m $m --target cuda:sm_90 --precision fp16 --buckets 32 --workdir $w > $w.$s.log 2>&1 || { echo "$m $s FAILED: $(tail -1 $w.$s.log)"; break; }; done
  echo "$m: $(grep 'build: bucket' $w.build.log | sed 's/.*build: //')"
  python - $w <<'PY'
import sys, pathlib
sys.path.insert(0, '.')
from deploy.tvm_compat import tirx
from deploy import optimize
try:
    mod = optimize.load(pathlib.Path(sys.argv[1]) / 'optimize').load_module(32)
    print('   padded:', [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and '_pad = T.sblock_alloc' in f.script()])
except Exception as e: print('  ', e)
PY
done
