"""Data movement after mixed precision: casts moved below it, exact cast round
trips removed, and a `take` of one constant index made a slice.

Our own Relax pass, run right after mixed precision. TVM's ToMixedPrecision
keeps ops outside its fp16 lists in fp32 and casts their inputs at each use,
one cast per use. A vision transformer's attention splits its fused QKV
tensor with three `take`s: the whole (3, N, heads, seq, dim) tensor was cast
from fp16 to fp32 three times per layer, each `take` copied its third in
fp32 in a kernel of its own, and q, k and v were cast back to fp16 (ViT-S/16
at batch 32 on the H200: 18 of those casts at 10.1 us each,
results/h200/2026-12-03/vit-fp16-b32-flat-gemm/). Data movement commutes
with a cast, and a value widened exactly (fp16 or bf16 to fp32, any float to
fp64) and narrowed back to its own type is itself, so:

  - `move(astype(x, T))` -> `astype(move(x), T)` for `take`, `permute_dims`,
    `reshape`, `squeeze`, `expand_dims` and `strided_slice`: the cast runs
    on what is left after the move;
  - `astype(astype(x, wide), x.dtype)` -> `x` where the widening is exact;
  - `take(x, i, axis)` with one constant index `i` -> `squeeze(strided_slice(
    x, [axis], [i], [i + 1]), [axis])`: TVM's `take` reads its index from a
    tensor and is left out of fusion (FuseOps sees an opaque kernel), a
    slice is fused into the kernel that consumes it.

Each leaves every value bit for bit as it was (tests/passes/test_movement.py).
"""

from __future__ import annotations

from . import call_rewrite_pass, pruned, tensor_dtype

MOVES = frozenset({
    "relax.take", "relax.permute_dims", "relax.reshape", "relax.squeeze", "relax.expand_dims",
    "relax.strided_slice",
})
EXACT_WIDENING = {
    ("float16", "float32"), ("bfloat16", "float32"), ("float16", "float64"), ("bfloat16", "float64"),
    ("float32", "float64"),
}


def _ndim(expr) -> int | None:
    try:
        return int(expr.ty.ndim)
    except (AttributeError, TypeError):
        return None


def tidy_movement():
    """A pass: see the module's docstring."""
    from ..tvm_compat import relax, tvm

    op = relax.op
    astype = tvm.ir.Op.get("relax.astype")
    take = tvm.ir.Op.get("relax.take")

    def cast_behind(builder, expr):
        """The `astype` call that `expr` is bound to, else None."""
        if not isinstance(expr, relax.Var):
            return None
        value = builder.lookup_binding(expr)
        if isinstance(value, relax.Call) and value.op == astype:
            return value
        return None

    def constant_index(call) -> tuple[int, int] | None:
        """(index, axis) of a `take` of one constant scalar index, else None."""
        x, idx = call.args
        ndim = _ndim(x)
        if not isinstance(idx, tvm.ir.expr.Constant) or idx.value.numpy().shape != () or ndim is None:
            return None
        axis = int(call.attrs.axis) if call.attrs.axis is not None else None
        if axis is None:  # (take over the flattened tensor)
            return None
        axis %= ndim
        i = int(idx.value.numpy())
        try:
            extent = int(x.ty.shape[axis])
        except (TypeError, ValueError):
            return None
        if 0 <= i < extent:
            return i, axis
        if str(call.attrs.mode) == "wrap":
            return i % extent, axis
        return None  # (out of bounds under 'fast', 'clip' or 'nan': left to TVM's take, as it was)

    def as_slice(builder, call):
        """A `take` of one constant index as squeeze(strided_slice(...)), else None."""
        at = constant_index(call) if call.op == take else None
        if at is None:
            return None
        i, axis = at
        return op.squeeze(builder.emit(op.strided_slice(call.args[0], [axis], [i], [i + 1])), [axis])

    def rewrite(builder, _mod, call):
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return None
        inner = cast_behind(builder, call.args[0])
        if inner is not None:
            src = inner.args[0]
            if call.op.name in MOVES:
                moved = relax.Call(call.op, [src, *call.args[1:]], call.attrs)
                sliced = as_slice(builder, moved)
                return op.astype(builder.emit(moved if sliced is None else sliced), tensor_dtype(inner))
            if call.op == astype and tensor_dtype(src) == tensor_dtype(call) \
                    and (tensor_dtype(src), tensor_dtype(inner)) in EXACT_WIDENING:
                return src
        return as_slice(builder, call)

    # (then the casts and copies nothing reads any more go)
    return pruned("TidyMovement", call_rewrite_pass("TidyMovement", rewrite))
