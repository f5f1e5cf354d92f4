"""Weights moved and cast in NumPy: `permute_dims`, `reshape`, `astype` and
`layout_transform` of a constant folded without compiling a kernel.

Our own Relax pass, run before each of the optimize stage's FoldConstant
passes. TVM's FoldConstant evaluates a call on constants by legalizing it,
compiling the PrimFunc with LLVM and running it; every weight shape is a new
PrimFunc. ResNet-50's layout change (each convolution's weights OIHW ->
OHWI), its fp16 casts and split-K's reshapes made 300 such calls a bucket,
9.5 of the 15 s the CPU machine took to optimize one bucket for CUDA; the
CPU path's NCHWc weight layouts (`layout_transform` by a TIR IndexMap) 3.7 s
a bucket. These ops only move or round data, so NumPy does them bit for bit
as TVM's kernels would (float narrowing rounds to nearest even in both; an
IndexMap is evaluated over every index at once, and taken only where it
moves each element to a place of its own, without padding; TVM's own
IndexMap.map_tensor took 65 s for ResNet-50's 106 weights). The module after
the whole optimize stage is structurally equal to the one FoldConstant alone
made (tests/passes/test_fold_weights.py). Other calls on constants are left
to FoldConstant.
"""

from __future__ import annotations

import math

import numpy as np

from . import call_rewrite_pass, static_shape

# The dtypes NumPy holds exactly as TVM does (bfloat16 and the fp8 types have no NumPy dtype).
_NUMPY_DTYPES = frozenset({
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool",
})


def _exact_cast(src: np.dtype, dst: np.dtype) -> bool:
    """Casts NumPy makes as TVM's kernels do: between floats (rounding to
    nearest even), and from integers; not float to integer or to bool,
    where out-of-range values are undefined behaviour in TVM's C casts."""
    return (src.kind == "f" and dst.kind == "f") or (src.kind in "iu" and dst.kind in "iuf")


def _moved(index_map, data: np.ndarray) -> np.ndarray | None:
    """`data` laid out by a TIR IndexMap (each element to the index its
    expressions give), evaluated in NumPy over every index at once; None
    where the map is not a bijection onto a tensor of the same size (padding,
    or an expression this evaluator does not know)."""
    from ..tvm_compat import tirx

    grids = np.indices(data.shape, sparse=True)
    names = {v.name: g for v, g in zip(index_map.initial_indices, grids)}
    ops = {tirx.Add: np.add, tirx.Sub: np.subtract, tirx.Mul: np.multiply, tirx.FloorDiv: np.floor_divide,
           tirx.FloorMod: np.mod}

    def ev(e):
        if isinstance(e, tirx.Var):
            return names[e.name]
        if isinstance(e, tirx.IntImm):
            return int(e.value)
        op = ops.get(type(e))
        if op is None:
            raise KeyError(type(e).__name__)
        return op(ev(e.a), ev(e.b))

    try:
        shape = [int(d) for d in index_map.map_shape(list(data.shape))]
        where = [np.broadcast_to(ev(e), data.shape) for e in index_map.final_indices]
    except (KeyError, TypeError, ValueError):
        return None
    if math.prod(shape) != data.size or any((w < 0).any() or (w >= n).any() for w, n in zip(where, shape)):
        return None
    flat = np.ravel_multi_index(tuple(w.ravel() for w in where), shape)
    if np.bincount(flat, minlength=data.size).max(initial=0) > 1:
        return None  # (two elements to one place: not a layout)
    out = np.empty(shape, data.dtype)
    out[tuple(where)] = data
    return out


def fold_weights():
    """A pass: see the module's docstring."""
    from ..tvm_compat import RelaxConstant, relax, tvm

    permute = tvm.ir.Op.get("relax.permute_dims")
    reshape = tvm.ir.Op.get("relax.reshape")
    astype = tvm.ir.Op.get("relax.astype")
    layout = tvm.ir.Op.get("relax.layout_transform")

    def constant_of(builder, expr):
        if isinstance(expr, relax.Var):
            try:
                expr = builder.lookup_binding(expr)
            except Exception:  # noqa: BLE001  (a function parameter: no binding)
                return None
        value = getattr(expr, "value", None) if isinstance(expr, RelaxConstant) else None
        return value if hasattr(value, "numpy") else None  # (a tensor; IntImm is a constant too)

    def rewrite(builder, _mod, call):
        if not isinstance(call.op, tvm.ir.Op) or not any(call.op.same_as(o) for o in (permute, reshape, astype, layout)):
            return None
        value = constant_of(builder, call.args[0])
        if value is None or str(value.dtype) not in _NUMPY_DTYPES:
            return None
        data = value.numpy()
        if call.op.same_as(layout):
            if call.attrs.pad_value is not None:
                return None
            out = _moved(call.attrs.index_map, data)
            return None if out is None else relax.const(out, str(out.dtype))
        if call.op.same_as(permute):
            axes = call.attrs.axes
            out = np.transpose(data, None if axes is None else [int(a) for a in axes])
        elif call.op.same_as(reshape):
            shape = static_shape(call)
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
