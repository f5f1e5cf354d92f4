"""Transposes that undo each other removed, after the NHWC layout change.

Our own Relax pass, run after ConvertLayout (in fp16, after mixed precision:
see below). A PyTorch model that
changes layout itself (ConvNeXt: each block's depthwise convolution in NCHW,
`permute(0, 2, 3, 1)` to LayerNorm and its MLP in NHWC, `permute(0, 3, 1, 2)`
back; Swin, MobileViT and other hybrids alike) keeps its residual stream in
NCHW. Once ConvertLayout has made the convolutions NHWC, the graph carries
transposes that cancel: NHWC -> NCHW for the residual add, then NCHW -> NHWC
into the next convolution, and the model's own permutes made identities. TVM
fuses each into a kernel of its own or into a neighbour's (ConvNeXt-T at batch
32 on the H200: 1.0 ms of its 5.7 ms in kernels that only transpose,
results/h200/2026-12-04/convnext-fp16-b32-tune-2/). Rewrites, each exact:

  - `permute_dims(x, identity)` -> `x`;
  - `permute_dims(permute_dims(x, p), q)` -> `permute_dims(x, p then q)`,
    or `x` where that is the identity;
  - `op(permute_dims(a, p), permute_dims(b, p))` -> `permute_dims(op(a, b), p)`
    for an elementwise binary `op` on two tensors of one shape (the residual
    add: then its transpose meets the next one, and both go).

The permutes nothing reads any more are removed, and a function keeps the
rewrite only where it holds fewer transposes than before: moving a residual
add behind its operands' transposes gains nothing where no transpose meets
the result, and it can split a transpose from the reshape TVM fused it with
(MLP-Mixer's token mixing: one more kernel a run). Tests:
tests/passes/test_transposes.py.

In fp16 the pass runs after ToMixedPrecision, not before it: TVM's pass keeps
a "follow" op (layer_norm, add) in fp32 when any input is fp32, and which
inputs are depends on the graph it is given; on ConvNeXt without the
transposes it kept each block's LayerNorm and residual stream in fp32 and
added two fp32 -> fp16 cast kernels a block, where after it every kernel of
the block reads and writes fp16.
"""

from __future__ import annotations

from . import call_rewrite_pass, pruned

BINARY_ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
})


def _axes(call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) % ndim for a in axes]


def _shape(expr) -> list[int] | None:
    try:
        return [int(d) for d in expr.ty.shape.values]
    except (AttributeError, TypeError, ValueError):
        return None


def cancel_transposes():
    """A pass: see the module's docstring."""
    from ..tvm_compat import relax, tvm

    permute = tvm.ir.Op.get("relax.permute_dims")

    def permute_behind(builder, expr):
        """The permute_dims call `expr` is bound to, with its static input shape; else None."""
        if not isinstance(expr, relax.Var):
            return None
        try:
            value = builder.lookup_binding(expr)
        except Exception:  # noqa: BLE001  (a parameter)
            return None
        if isinstance(value, relax.Call) and value.op.same_as(permute) and _shape(value.args[0]) is not None:
            return value
        return None

    def rewrite(builder, _mod, call):
        if not isinstance(call.op, tvm.ir.Op):
            return None
        if call.op.same_as(permute):
            shape = _shape(call.args[0])
            if shape is None:
                return None
            axes = _axes(call, len(shape))
            inner = permute_behind(builder, call.args[0])
            if inner is not None:  # y = x.permute(p); y.permute(q)[i] = x.permute(p)[q[i]] = x[p[q[i]]]
                p = _axes(inner, len(axes))
                axes = [p[a] for a in axes]
                src = inner.args[0]
            else:
                src = call.args[0]
            if axes == list(range(len(axes))):
                return src
            return relax.op.permute_dims(src, axes) if inner is not None else None
        if call.op.name in BINARY_ELEMENTWISE and len(call.args) == 2:
            a, b = (permute_behind(builder, x) for x in call.args)
            if a is None or b is None:
                return None
            pa, pb = _shape(a.args[0]), _shape(b.args[0])
            if pa != pb or _axes(a, len(pa)) != _axes(b, len(pb)):
                return None
            inner = builder.emit(relax.Call(call.op, [a.args[0], b.args[0]], call.attrs))
            return relax.op.permute_dims(inner, _axes(a, len(pa)))
        return None

    rewritten = pruned("CancelTransposes", call_rewrite_pass("CancelTransposes", rewrite))

    @tvm.transform.module_pass(opt_level=0, name="CancelTransposes")
    def run(mod, _ctx):
        out = rewritten(mod)
        for gv, func in list(out.functions.items()):
            if isinstance(func, relax.Function) and gv in mod and count_transposes(func) >= count_transposes(mod[gv]):
                out[gv] = mod[gv]  # nothing cancelled: the function as it was (see the module's docstring)
        return out

    return run


def count_transposes(func) -> int:
    """permute_dims calls in a Relax function."""
    from ..tvm_compat import relax, tvm

    permute = tvm.ir.Op.get("relax.permute_dims")
    n = 0

    def visit(expr):
        nonlocal n
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(permute):
            n += 1

    relax.analysis.post_order_visit(func, visit)
    return n
