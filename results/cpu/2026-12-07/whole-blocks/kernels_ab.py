"""Per-kernel A/B of the llvm chain, from the repository root:
    ONLYDIFF=1 PYTHONPATH=. python kernels_ab.py W/<model>-fp32/optimize/b1.relax.json . \
        old:cpu_default.WHOLE_BLOCKS=False new:
Each variant sets module constants of deploy.passes (`module.NAME=expr;...`), schedules each kernel whose
name matches the regex with the llvm chain's rules and builds it; then each variant is timed (median of 7 x 5
calls) and its outputs compared with the first variant's. ONLYDIFF=1: only kernels the first two variants
schedule differently. PART=1: TVM's loop partitioning on (tried, not adopted: no gain). TURNS=1: the
variants timed in turns, ROUNDS rounds (default 9) of 3 x 5 calls each, each variant's median printed (on a
machine whose speed moves within seconds, one variant timed after the other is not a fair comparison)."""
import sys, re, tvm, importlib
from deploy.tvm_compat import *  # noqa
from deploy.passes import cpu_default, cpu_reduction, schedule as S
from deploy.tuning.check import _buffers, _seeded_args, _worst
from deploy.build import build_kernel as _bk
import os
def build_kernel(name, func, TI):
    cfg = {"s_tir.LoopPartition": {"partition_const_loop": True}} if os.environ.get("PART") else {}
    from deploy.tvm_compat import PassContext
    from deploy.passes import tensor_core_smem
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    t = TI.tvm_target()
    with t, PassContext(opt_level=3, config=cfg):
        return tvm.tirx.build(mod, target=t, pipeline=tensor_core_smem.register())
from deploy import targets as T_
TI = T_.resolve("llvm"); target = TI.tvm_target(); dev = tvm.cpu()
mod = tvm.ir.load_json(open(sys.argv[1]).read())
pat = re.compile(sys.argv[2])
variants = [v.split(":", 1) for v in sys.argv[3:]] or [["base", ""]]
def sched(func):
    for name, rule in S.rules("llvm"):
        if rule is None: continue
        s = rule.apply(func, target, False)
        if s is not None: return name, s.mod["main"]
    return "default", func
for gv in mod.functions:
    func = mod[gv]
    if not isinstance(func, tvm.tirx.PrimFunc) or not pat.search(gv.name_hint): continue
    func = func.with_attr("global_symbol", "main")
    bufs = _buffers(func); outs = {}; line = []
    if os.environ.get("ONLYDIFF"):
        texts = []
        for label, stmts in variants[:2]:
            saved = {}
            for st in filter(None, stmts.split(";")):
                k, v = st.split("=", 1); m, a = k.strip().rsplit(".", 1); M = importlib.import_module("deploy.passes." + m)
                saved[(M, a)] = getattr(M, a); setattr(M, a, eval(v))
            try: texts.append(sched(func)[1].script())
            finally:
                for (M, a), v in saved.items(): setattr(M, a, v)
        if texts[0] == texts[1]: continue
    libs = {}
    for label, stmts in variants:
        saved = {}
        for st in filter(None, stmts.split(";")):
            k, v = st.split("=", 1); m, a = k.strip().rsplit(".", 1); M = importlib.import_module("deploy.passes." + m)
            saved[(M, a)] = getattr(M, a); setattr(M, a, eval(v))
        try:
            rn, f = sched(func)
            lib = build_kernel("main", f, TI)
            args = [tvm.runtime.tensor(a, dev) for a in _seeded_args(bufs)]
            lib["main"](*args); outs[label] = [a.numpy() for a in args]
            libs[label] = (lib, args)
        except Exception as e:
            line.append(f"{label}=ERR {str(e).splitlines()[0][:80]}")
        finally:
            for (M, a), v in saved.items(): setattr(M, a, v)
    import statistics
    times = {l: [] for l in libs}
    turns = bool(os.environ.get("TURNS"))
    for _ in range(int(os.environ.get("ROUNDS", "9")) if turns else 1):
        for l, (lib, args) in libs.items():
            timer = lib.time_evaluator("main", dev, number=5, repeat=3 if turns else 7, min_repeat_ms=10 if turns else 20)
            times[l].append(timer(*args).median * 1e3)
    for l in libs:
        ok = "" if l == variants[0][0] else ("ok" if _worst(bufs, outs[l], outs[variants[0][0]]).get("ok") else "MISMATCH")
        line.append(f"{l}={statistics.median(times[l]):.4f}{ok and ' '+ok}")
    print(f"{gv.name_hint:48s} " + "  ".join(line), flush=True)
