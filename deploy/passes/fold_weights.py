"""Weights moved and cast in NumPy: `permute_dims`, `reshape` and `astype` of
a constant folded without compiling a kernel.

Our own Relax pass, run before each of the optimize stage's FoldConstant
passes. TVM's FoldConstant evaluates a call on constants by legalizing it,
compiling the PrimFunc with LLVM and running it; every weight shape is a new
PrimFunc. ResNet-50's layout change (each convolution's weights OIHW ->
OHWI), its fp16 casts and split-K's reshapes made 300 such calls a bucket,
9.5 of the 15 s the CPU machine took to optimize one bucket. These three ops
only move or round data, so NumPy does them bit for bit as TVM's kernels
would (float narrowing rounds to nearest even in both; the module after the
whole optimize stage is structurally equal to the one FoldConstant alone
made: tests/passes/test_fold_weights.py). Other calls on constants are left
to FoldConstant.
"""

from __future__ import annotations

import numpy as np

from . import call_rewrite_pass

# The dtypes NumPy holds exactly as TVM does (bfloat16 and the fp8 types have no NumPy dtype).
_NUMPY_DTYPES = frozenset({
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool",
})


def _static_shape(expr) -> list[int] | None:
    try:
        return [int(d) for d in expr.ty.shape.values]
    except (AttributeError, TypeError):
        return None


def _exact_cast(src: np.dtype, dst: np.dtype) -> bool:
    """Casts NumPy makes as TVM's kernels do: between floats (rounding to
    nearest even), and from integers; not float to integer or to bool,
    where out-of-range values are undefined behaviour in TVM's C casts."""
    return (src.kind == "f" and dst.kind == "f") or (src.kind in "iu" and dst.kind in "iuf")


def fold_weights():
    """A pass: see the module's docstring."""
    from ..tvm_compat import RelaxConstant, relax, tvm

    permute = tvm.ir.Op.get("relax.permute_dims")
    reshape = tvm.ir.Op.get("relax.reshape")
    astype = tvm.ir.Op.get("relax.astype")

    def constant_of(builder, expr):
        if isinstance(expr, relax.Var):
            try:
                expr = builder.lookup_binding(expr)
            except Exception:  # noqa: BLE001  (a function parameter: no binding)
                return None
        value = getattr(expr, "value", None) if isinstance(expr, RelaxConstant) else None
        return value if hasattr(value, "numpy") else None  # (a tensor; IntImm is a constant too)

    def rewrite(builder, _mod, call):
        if not isinstance(call.op, tvm.ir.Op) or not any(call.op.same_as(o) for o in (permute, reshape, astype)):
            return None
        value = constant_of(builder, call.args[0])
        if value is None or str(value.dtype) not in _NUMPY_DTYPES:
            return None
        data = value.numpy()
        if call.op.same_as(permute):
            axes = call.attrs.axes
            out = np.transpose(data, None if axes is None else [int(a) for a in axes])
        elif call.op.same_as(reshape):
            shape = _static_shape(call)
            if shape is None:
                return None
            out = data.reshape(shape)
        else:
            dtype = str(call.attrs.dtype)
            if dtype not in _NUMPY_DTYPES or not _exact_cast(data.dtype, np.dtype(dtype)) or data.ndim == 0:
                return None  # (TVM 0.27's FoldConstant leaves the cast of a 0-d constant: so does this pass)
            with np.errstate(over="ignore", invalid="ignore"):  # (inf, as TVM rounds it)
                out = data.astype(dtype)
        # (np.require keeps a 0-d array 0-d: np.ascontiguousarray would make a scalar shape (1,))
        return relax.const(np.require(out, requirements="C"), str(out.dtype))

    return call_rewrite_pass("FoldWeights", rewrite)
