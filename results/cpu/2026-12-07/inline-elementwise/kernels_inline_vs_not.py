"""Each kernel of an optimized module that our InjectiveParallel takes and whose schedule the inlining changes:
built with cpu_default.INLINE False (old) and True (new), timed (median of 5 x 3 calls), outputs compared.
python kernels_inline_vs_not.py WORKDIR/optimize/b1.relax.json"""
import sys, tvm
from deploy.tvm_compat import *  # noqa
from deploy.passes import cpu_default
from deploy.passes.cpu_default import InjectiveParallel
from deploy.tuning.check import _buffers, _seeded_args, _worst
from deploy.build import build_kernel
from deploy import targets as T_
TI = T_.resolve("llvm"); target = TI.tvm_target(); dev = tvm.cpu()
mod = tvm.ir.load_json(open(sys.argv[1]).read())
for gv in mod.functions:
    func = mod[gv]
    if not isinstance(func, tvm.tirx.PrimFunc): continue
    func = func.with_attr("global_symbol", "main")
    scheds = {}
    for label, flag in (("old", False), ("new", True)):
        cpu_default.INLINE = flag
        scheds[label] = InjectiveParallel().apply(func, target, False)
    if scheds["new"] is None or scheds["new"].mod.script() == scheds["old"].mod.script(): continue
    bufs = _buffers(func); outs = {}; ts = {}
    for label in ("old", "new"):
        lib = build_kernel("main", scheds[label].mod["main"], TI)
        args = [tvm.runtime.tensor(a, dev) for a in _seeded_args(bufs)]
        ts[label] = lib.time_evaluator("main", dev, number=3, repeat=5)(*args).median * 1e3
        lib["main"](*args); outs[label] = [a.numpy() for a in args]
    w = _worst(bufs, outs["new"], outs["old"])
    print(f"{gv.name_hint:60s} {ts['old']:.3f} -> {ts['new']:.3f}  ok={w.get('ok')} {w.get('rel_l2', 0):.1e}")
