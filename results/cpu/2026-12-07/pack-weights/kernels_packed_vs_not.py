"""Each kernel pack_weights packs, timed packed and unpacked (the default CPU
schedule both ways; interleaved, best of 5 x 20 calls):
    python kernels_packed_vs_not.py CORPUS_WORKDIR MODEL...  (a scripts/corpus.py --work folder, llvm)"""
import sys, numpy as np, tvm
from deploy import config, optimize, targets as TG
from deploy.build import build_kernel
from deploy.passes import cpu_default, pack_weights
from deploy.tvm_compat import load_json, tirx
info = TG.resolve("llvm"); target = info.tvm_target(); dev = tvm.cpu(0)

for m in sys.argv[2:]:
    profile = config.from_dict({"model": {"source": m}}).llvm
    mods = {}
    for pack in (True, False):
        pack_weights.PACK = pack
        frontend = load_json(open(f"{sys.argv[1]}/{m}-fp32/frontend/b1.relax.json").read())
        mods[pack], _ = optimize.optimize_module(frontend, profile, target)
    pack_weights.PACK = True
    plain = {gv.name_hint: f for gv, f in mods[False].functions_items() if isinstance(f, tirx.PrimFunc)}
    for gv, f in mods[True].functions_items():
        if not isinstance(f, tirx.PrimFunc) or pack_weights.ATTR not in (f.attrs or {}):
            continue
        pair = {True: f, False: plain[gv.name_hint]}
        libs, arrs = {}, {}
        for pack, func in pair.items():
            sch = cpu_default.ContractionTiling().apply(func, target)
            libs[pack] = build_kernel("k", sch.mod["main"].with_attr("tirx.is_scheduled", True), info)
            rng = np.random.default_rng(0)
            arrs[pack] = [tvm.runtime.tensor(rng.random([int(x) for x in p.shape]).astype(str(p.dtype)), dev)
                          for p in func.params]
        t = {True: [], False: []}
        for rep in range(5):
            for pack in (True, False):
                t[pack].append(libs[pack].time_evaluator("k", dev, number=20, repeat=1)(*arrs[pack]).median * 1e3)
        a, b = min(t[True]), min(t[False])
        shapes = [[int(x) for x in p.shape] for p in pair[False].params][:2]
        print(f"{m} {gv.name_hint[:48]:48s} {shapes} packed {a:.4f} unpacked {b:.4f} ms  {b / a:.2f}x", flush=True)
