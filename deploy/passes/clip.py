"""Workaround: TVM 0.27's ONNX frontend writes Clip as opaque kernels, which
no layout pass can see into.

Upstream symptom (TVM 0.27, `relax.frontend.onnx`, Clip from opset 11 on):
the bounds are tensors, so the frontend emits `call_tir(maximum, [x, lo])`
and `call_tir(minimum, [x, hi])` (`bb.emit_te(topi.maximum, ...)`) instead of
Relax operators. ConvertLayout knows nothing of a `call_tir`, so it moves
the tensor back to NCHW before each one and to the blocked layout after:
MobileNetV2's 35 ReLU6 became 70 layout transforms, and its 33 kernels 69
(`results/cpu/2026-12-03/`).

Scope: a `call_tir` whose kernel is exactly TOPI's `maximum` or `minimum` of
a tensor and a 0-d bound (compared structurally with the kernel TOPI makes
for the same shapes and dtypes) becomes `R.maximum` / `R.minimum`; nothing
else is touched. The `R.clip` that TVM's HardSwish and HardSigmoid
conversions write (MobileNetV3) is transformed around the same way in 0.27
(56 layout transforms for its 28): it becomes `R.minimum(R.maximum(x, lo),
hi)` (MobileNetV3 untuned: 125 -> 53 kernels, 2.5x -> 1.5x ONNX Runtime's
time). It runs before the NCHWc layout phase only (the CPU).
`tests/passes/test_nchwc.py` checks that the frontend still writes Clip as
`call_tir`, and fails once it writes Relax operators.
"""

from __future__ import annotations

from . import call_rewrite_pass


def _reference(name: str, x_ty, bound_ty):
    from ..tvm_compat import te, topi

    a = te.placeholder(list(x_ty.shape), str(x_ty.dtype), "x")  # the frontend's int64 extents
    b = te.placeholder([], str(bound_ty.dtype), "bound")
    return te.create_prim_func([a, b, getattr(topi, name)(a, b)])


def _same(func, ref) -> bool:
    import tvm_ffi

    strip = ("global_symbol", "tir.noalias", "tirx.noalias", "s_tir")
    for k in strip:
        func, ref = func.without_attr(k), ref.without_attr(k)
    return bool(tvm_ffi.structural_equal(func, ref, map_free_vars=True))


def _number(arg) -> float | None:
    v = getattr(arg, "value", None)
    v = getattr(v, "value", v)  # a PrimValue around a FloatImm, or the FloatImm itself
    return float(v) if isinstance(v, (int, float)) else None


def _clip_as_max_min(builder, call):
    """R.clip(x, lo, hi) with constant bounds as R.minimum(R.maximum(x, lo), hi)."""
    from ..tvm_compat import relax

    x, lo, hi = call.args
    lo, hi = _number(lo), _number(hi)
    if lo is None or hi is None or not isinstance(x.ty, relax.TensorType):
        return None
    dtype = str(x.ty.dtype)
    low = builder.emit(relax.op.maximum(x, relax.const(lo, dtype)))
    return relax.op.minimum(low, relax.const(hi, dtype))


def clip_kernels_to_ops():
    from ..tvm_compat import Sequential, relax, tvm

    call_tir = tvm.ir.Op.get("relax.call_tir")
    clip = tvm.ir.Op.get("relax.clip")
    ops = {"maximum": relax.op.maximum, "minimum": relax.op.minimum}

    def rewrite(builder, mod, call):
        if call.op == clip:
            return _clip_as_max_min(builder, call)
        if call.op != call_tir or not isinstance(call.args[1], relax.Tuple):
            return None
        gv, args, out_ty = call.args[0], call.args[1].fields, call.ty
        func = mod[gv] if gv in mod.functions else None
        name = next((n for n in ops if gv.name_hint.startswith(n)), None)
        if name is None or len(args) != 2 or not isinstance(func, tvm.tirx.PrimFunc):
            return None
        x_ty, bound_ty = (a.ty for a in args)
        if not (isinstance(x_ty, relax.TensorType) and isinstance(bound_ty, relax.TensorType)
                and isinstance(out_ty, relax.TensorType) and bound_ty.ndim == 0
                and x_ty.shape is not None and str(x_ty.dtype) == str(bound_ty.dtype)):
            return None
        try:
            if not _same(func, _reference(name, x_ty, bound_ty)):
                return None
        except Exception:  # noqa: BLE001 - a symbolic shape, anything TOPI cannot rebuild: left as it is
            return None
        return ops[name](*args)

    return Sequential([call_rewrite_pass("ClipKernelsToOps", rewrite), relax.transform.DeadCodeElimination()],
                      name="ClipKernelsToOps")
