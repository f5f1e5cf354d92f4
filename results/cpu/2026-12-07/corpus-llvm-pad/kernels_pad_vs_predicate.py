"""Each kernel cpu_default pads, timed padded and predicated (interleaved, best of 5 x 20 calls):
    python kernels_pad_vs_predicate.py CORPUS_WORKDIR MODEL...  (a scripts/corpus.py --work folder, llvm)"""
import sys, numpy as np, tvm
from deploy.passes import cpu_default
from deploy import targets as TG
target = TG.resolve("llvm").tvm_target(); dev = tvm.cpu(0)
for m in sys.argv[2:]:
    mod = tvm.ir.load_json(open(f"{sys.argv[1]}/{m}-fp32/optimize/b1.relax.json").read())
    for gv, f in mod.functions.items():
        if not isinstance(f, tvm.tirx.PrimFunc): continue
        f = f.with_attr("global_symbol", "main")
        libs = {}
        for pad in (True, False):
            cpu_default.PAD = pad
            s = cpu_default.ContractionTiling().apply(f, target)
            libs[pad] = None if s is None else s.mod.script()
        if libs[True] is None or libs[True] == libs[False]: continue
        rng = np.random.default_rng(0)
        base = [rng.random([int(x) for x in p.shape]).astype(str(p.dtype)) for p in f.params]
        t = {True: [], False: []}
        built = {}
        for pad in (True, False):
            cpu_default.PAD = pad
            s = cpu_default.ContractionTiling().apply(f, target)
            built[pad] = tvm.compile(tvm.IRModule({"main": s.mod["main"]}), target=target)
        arrs = [tvm.runtime.tensor(a, dev) for a in base]
        for rep in range(5):
            for pad in (True, False):
                t[pad].append(built[pad].mod.time_evaluator("main", dev, number=20, repeat=1)(*arrs).median * 1e3)
        a, b = min(t[True]), min(t[False])
        print(f"{m} {gv.name_hint[:50]:50s} shape {[ [int(x) for x in p.shape] for p in f.params][:2]} pad {a:.4f} pred {b:.4f} ms  {b/a:.2f}x", flush=True)
