"""The fp32 cast before a mean fused into the mean's kernel.

Our own Relax pass, run in the fusion phase before LegalizeOps. Mixed
precision keeps `mean` in fp32: it casts the fp16 feature map to fp32 and
the mean back to fp16. TOPI legalizes `mean` to a sum and a division, which
TVM's AnnotateTIROpPattern classes as "out-elementwise fusable" (a
reduction with an epilogue), and FuseOps fuses no producer into such a
kernel. So the cast ran as a kernel of its own that wrote the whole feature
map in fp32, twice the bytes it read, and the mean read it back: EfficientNet-B0
at batch 32 on the H200 had 16 of those casts before its squeeze-excitation
means, 0.45 ms of its 4.18 ms in kernels
(results/h200/2026-12-03/efficientnet_b0-fp16-b32-short-reduction/profile.md:
cast2, cast13, cast39, ...), one before each squeeze-excitation block.

This pass groups `astype(mean(astype(x, fp32)), ...)` (and `mean(astype(x,
fp32))` where no cast follows) into one fused function: FuseTIR makes it one
kernel whose reduction reads fp16 and accumulates in fp32, exactly the
arithmetic it replaces. Only a widening cast (fp16 or bf16 to fp32) with no
other reader, and only where it is a kernel of its own: the fp16 map has
another reader too (a squeeze-excitation's multiply), else FuseOps fused the
cast into the kernel that makes the map. Only where the result's readers
are kernels of their own or views: one FuseOps fused into the mean's
kernel (a group norm's `x - mean`) would be kept out of a group of ours.

tests/passes/test_mean_cast.py also fails once FuseOps fuses the cast into
the mean by itself; the pass can go then.
"""

from __future__ import annotations

from . import tensor_dtype

WIDENING = {("float16", "float32"), ("bfloat16", "float32")}


def fuse_mean_casts():
    """A pass: see the module's docstring."""
    from ..tvm_compat import relax, tvm

    is_op, wildcard = relax.dpl.is_op, relax.dpl.wildcard
    x = wildcard()
    widen = is_op("relax.astype")(x)
    mean = is_op("relax.mean")(widen)
    narrow = is_op("relax.astype")(mean)

    @tvm.transform.module_pass(opt_level=0, name="fuse_mean_casts")
    def run(mod, _ctx):
        users = _user_ops(mod)

        def single_use(ctx, expr) -> bool:
            var = ctx.value_to_bound_var.get(expr)
            return var is not None and len(ctx.var_usages.get(var, [])) == 1

        def check(ctx) -> bool:
            m = ctx.annotated_expr
            inner, source = m["widen"], m["x"]
            if (tensor_dtype(source), tensor_dtype(inner)) not in WIDENING or not single_use(ctx, inner):
                return False
            # The cast is a kernel of its own only where the fp16 map has
            # another reader (a squeeze-excitation's multiply) or comes in as
            # a parameter; a sole reader's cast is fused into the producer's
            # epilogue already, in kernels that may be tuned (a classifier's
            # last convolution): left alone, their records still apply.
            var = source if isinstance(source, relax.Var) else ctx.value_to_bound_var.get(source)
            uses = None if var is None else ctx.var_usages.get(var)
            if uses is not None and len(uses) < 2:
                return False
            if "narrow" in m and not single_use(ctx, m["mean"]):
                return False
            # A reader FuseOps fused into the mean's kernel (a norm's
            # subtraction, a scale) could not join the group: left alone.
            out = ctx.value_to_bound_var.get(m.get("narrow", m["mean"]))
            return out is not None and not any(_may_join_mean_kernel(op) for op in users.get(out, ()))

        # (the pattern with the trailing cast first: the longer match wins)
        return relax.transform.FuseOpsByPattern(
            [("mean_cast", narrow, {"x": x, "widen": widen, "mean": mean, "narrow": narrow}, check),
             ("mean_cast", mean, {"x": x, "widen": widen, "mean": mean}, check)],
            bind_constants=False, annotate_codegen=False)(mod)

    return run


def _user_ops(mod) -> dict:
    """{Relax variable: the operators of the calls that read it}, over every
    Relax function's bindings."""
    from ..tvm_compat import relax, tvm

    out: dict = {}
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                value = getattr(binding, "value", None)
                if isinstance(value, relax.Call):
                    name = value.op.name if isinstance(value.op, tvm.ir.Op) else ""
                    for arg in value.args:  # (a tuple's fields too: concat's, call_tir's arguments)
                        for v in (arg.fields if isinstance(arg, relax.Tuple) else [arg]):
                            if isinstance(v, relax.Var):
                                out.setdefault(v, []).append(name)
    return out


# Readers that never shared the mean's kernel (their own kernels) or that
# become views of it (RewriteDataflowReshape): only there is the group a win.
KERNEL_OF_ITS_OWN = frozenset({
    "relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d", "relax.matmul", "relax.nn.linear",
    "relax.reshape", "relax.squeeze", "relax.flatten", "relax.expand_dims",
})


def _may_join_mean_kernel(op_name: str) -> bool:
    """Whether FuseOps may have fused a reader with this operator into the
    mean's kernel: any but those in KERNEL_OF_ITS_OWN."""
    return op_name not in KERNEL_OF_ITS_OWN
