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
    add: then its transpose meets the next one, and both go), only where it
    pays: both operands' transposes read by this op alone (two become one),
    or the op's result read by a transpose that undoes `p`. Elsewhere the
    move gains nothing and can split a transpose from the reshape TVM fused
    it with (MLP-Mixer's token mixing: one kernel more a run).

The permutes nothing reads any more are removed, and a function keeps the
rewrite only where it holds fewer transposes than before (a backstop).
Tests: tests/passes/test_transposes.py.

In fp16 the pass runs after ToMixedPrecision, not before it: TVM's pass keeps
a "follow" op (layer_norm, add) in fp32 when any input is fp32, and which
inputs are depends on the graph it is given; on ConvNeXt without the
transposes it kept each block's LayerNorm and residual stream in fp32 and
added two fp32 -> fp16 cast kernels a block, where after it every kernel of
the block reads and writes fp16.
"""

from __future__ import annotations

from . import static_shape

BINARY_ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
})


def _axes(call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) % ndim for a in axes]


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
        if isinstance(value, relax.Call) and value.op.same_as(permute) and static_shape(value.args[0]) is not None:
            return value
        return None

    def cancels(expr, p, uses) -> bool:
        """Whether a read of `expr` (a Var of the original function) is a
        permute_dims that undoes permutation `p`."""
        return any(isinstance(u, relax.Call) and u.op.same_as(permute) and [p[a] for a in _axes(u, len(p))] == list(range(len(p)))
                   for u in uses.get(expr, ()))

    def rewrite(builder, original, call, uses):
        if not isinstance(call.op, tvm.ir.Op):
            return None
        if call.op.same_as(permute):
            shape = static_shape(call.args[0])
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
            pa, pb = static_shape(a.args[0]), static_shape(b.args[0])
            if pa != pb or _axes(a, len(pa)) != _axes(b, len(pb)):
                return None
            p = _axes(a, len(pa))
            # Only where it pays: both operands' transposes read by this op alone (two become one), or the
            # result read by a transpose that undoes them (which then goes).
            single = all(len(uses.get(x, ())) == 1 for x in original.args)
            if not single and not cancels(uses.get(("result", original)), p, uses):
                return None
            inner = builder.emit(relax.Call(call.op, [a.args[0], b.args[0]], call.attrs))
            return relax.op.permute_dims(inner, p)
        return None

    @tvm.transform.module_pass(opt_level=0, name="CancelTransposes")
    def run(mod, _ctx):
        @relax.expr_functor.mutator
        class Rewrite(relax.PyExprMutator):
            def __init__(self, mod, uses):
                super().__init__(mod)
                self.uses = uses

            def visit_call_(self, call):
                new = super().visit_call_(call)
                out = rewrite(self.builder_, call, new, self.uses)
                return new if out is None else out

        out = mod.clone()
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function):
                continue
            new = relax.analysis.remove_all_unused(Rewrite(mod, _uses(func)).visit_expr(func))
            if count_transposes(new) < count_transposes(func):  # (a backstop: else the function as it was)
                out[gv] = new
        return out

    return run


def _uses(func) -> dict:
    """For a Relax function: each Var to the expressions that read it (the
    calls it is an argument of), and ("result", call) to the Var each call is
    bound to."""
    from ..tvm_compat import relax

    uses: dict = {}

    def reads(value):
        def visit(e):
            if isinstance(e, relax.Var):
                uses.setdefault(e, []).append(value)

        return visit

    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call):
                uses[("result", value)] = binding.var
                for arg in value.args:
                    if isinstance(arg, relax.Var):
                        uses.setdefault(arg, []).append(value)
            else:  # (a tuple, a var, ...: a read that is no transpose)
                relax.analysis.post_order_visit(value, reads(value))
    relax.analysis.post_order_visit(func.body.body, reads(func.body.body))
    return uses


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
