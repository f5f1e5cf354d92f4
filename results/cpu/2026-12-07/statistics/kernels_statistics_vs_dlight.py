"""Each kernel of an optimized module that DLight's CPU Reduction or our statistics rule takes: built with the chain without
the statistics rule (old) and with it (new), timed (median of 5 x 3 calls), outputs compared.
python kernels_statistics_vs_dlight.py WORKDIR/optimize/b1.relax.json"""
import sys, tvm
from deploy.tvm_compat import *  # noqa
from deploy.passes import schedule
import deploy.passes.cpu_reduction as cr
from deploy.tuning.check import _buffers, _seeded_args, _worst
from deploy.build import build_kernel
from deploy import targets as T_
TI = T_.resolve("llvm"); target = TI.tvm_target(); dev = tvm.cpu()
mod = tvm.ir.load_json(open(sys.argv[1]).read())
orig = cr.recomputed
force = None
tot_old = tot_new = 0
for gv in mod.functions:
    func = mod[gv]
    if not isinstance(func, tvm.tirx.PrimFunc): continue
    func = func.with_attr("global_symbol", "main")
    res = {}
    for label, rec in (("old", None), ("new", 1)):
        pass
        chain = [r for r in schedule.rules("llvm") if rec or r[0] != "statistics"]
        for rname, rule in chain:
            sch = rule.apply(func, target, False)
            if sch is not None: break
        else: rname, sch = "default", None
        res[label] = (rname, sch)
    if res["old"][0] not in ("dlight.Reduction", "broadcast-statistics") and res["new"][0] != "broadcast-statistics": continue
    bufs = _buffers(func); outs = {}; ts = {}
    for label in ("old", "new"):
        rname, sch = res[label]
        try:
            lib = build_kernel("main", (sch.mod if sch else tvm.IRModule({"main": func}))["main"], TI)
        except Exception as e:
            print(gv.name_hint, label, rname, "BUILD FAIL", str(e).splitlines()[-1][:100]); ts[label] = None; continue
        args = [tvm.runtime.tensor(a, dev) for a in _seeded_args(bufs)]
        ts[label] = lib.time_evaluator("main", dev, number=3, repeat=5)(*args).median * 1e3
        lib["main"](*args); outs[label] = [a.numpy() for a in args]
    w = _worst(bufs, outs["new"], outs["old"]) if len(outs) == 2 else {}
    print(f"{gv.name_hint:50s} {res['old'][0]:22s} {ts['old']:.3f} -> {res['new'][0]:22s} {ts['new']:.3f}  ok={w.get('ok')} {w.get('rel_l2', 0):.1e}")
