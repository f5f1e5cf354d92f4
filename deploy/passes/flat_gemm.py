"""1x1 convolutions and batched-row matmuls as 2-D GEMMs, epilogues included.

Our own Relax pass (the profile's `flat_gemm`, for the mma.sync tensor-core
rule; not a workaround of a defect, though it exists because of a limit):
MetaSchedule's mma.sync tiling (m16n8k8 with ldmatrix and a cp.async
pipeline) only takes a block with two spatial loops and one reduction loop,
and declines the rest ("The MMA tensor core only supports SSR loops now",
multi_level_tiling_tensor_core.cc). A fused NHWC 1x1 convolution has four
spatial loops (N, H, W, O) and a transformer's dense layer three (batch,
sequence, N): they only ever get WMMA candidates. The same GEMM written in
two dimensions, epilogue included, gets mma.sync candidates that pass every
postprocessor with our epilogue fix (passes/mma_epilogue.py): 14 of 200 draws
for ResNet-50's 12544x256x1024 GEMM with bias and ReLU
(`scripts/mma_probe.py --gemm 12544,256,1024 --epilogue bias-relu --fix-epilogue`).
`tests/passes/test_flat_gemm.py` fails once TVM tiles the 4-D form with
mma.sync.

So `flat_gemm()` rewrites
  - a 2-D convolution in NHWC/OHWI with a 1x1 kernel, stride 1, no padding,
    groups 1, static shapes: `x[N,H,W,C]` -> `matmul(reshape(x, [N*H*W, C]),
    W^T[C, O])`;
  - a matmul of an N-D left side (rank >= 3) by a 2-D right side:
    `x[..., K]` -> `reshape(x, [rows, K])`;
and carries the elementwise operators that follow (unary ones, casts, and
binary ones whose other side is the same shape or broadcasts along the last
axis alone: a bias, a residual) in two dimensions, so that FuseOps puts the
whole epilogue into the GEMM's kernel. The result is reshaped back where a
consumer needs the original shape: a reshape of a contiguous tensor, which
the build turns into a view (RewriteDataflowReshape), not a kernel.
"""

from __future__ import annotations

import math

from . import implicit_gemm, pruned, relax_function_pass, static_shape, tensor_dtype, wgmma_gemm
from .pad_gemm import pads

UNARY = frozenset({
    "relax.astype", "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.sigmoid",
    "relax.tanh", "relax.exp", "relax.erf", "relax.sqrt", "relax.negative", "relax.clip", "relax.abs",
    "relax.nn.leakyrelu", "relax.square",
})
BINARY = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
    "relax.power",
})


def flat_gemm(gemms: bool = True, pad_rows: bool = False, convs: bool = False, tf32: bool = False,
              wgmma: bool = False, conv1x1: bool = False):
    """A pass: see the module's docstring. `gemms=False` (`flat_epilogues()`)
    rewrites no convolution or matmul, and only carries the epilogues of
    2-D results viewed in more dimensions; with `pad_rows`, it also rewrites
    the N-D matmuls whose row count passes.pad_gemm pads (which only pads a
    GEMM whose rows are one loop); with `wgmma`, the N-D matmuls whose 2-D
    form passes.wgmma_gemm's kernel takes (which takes 2-D GEMMs only);
    with `convs`, the convolutions that passes.implicit_gemm takes become
    implicit GEMMs [N*Ho*Wo, O], their epilogues carried in 2-D as well
    (fp32 ones too with `tf32`; with `wgmma` too, those of fewer than 8
    channels, padded: implicit_gemm.padded_channels); with `conv1x1` (and
    `gemms=False`), the 1x1 convolutions are rewritten as `gemms` does (but
    those of a 1x1 map: `_conv1x1`), and the strided ones as implicit GEMMs
    with `convs`, the matmuls as without it."""
    from ..tvm_compat import relax, tvm

    op = relax.op
    reshape = tvm.ir.Op.get("relax.reshape")

    @relax.expr_functor.mutator
    class FlatGemm(relax.PyExprMutator):
        def __init__(self, mod=None):
            super().__init__(mod)
            self.flat = set()  # the 2-D vars this pass emitted (GEMM results and their epilogues)

        # A 2-D var is reused only inside the block that made it (a dataflow
        # var must not leave its block): the set starts afresh with each.
        def visit_dataflow_block_(self, block):
            self.flat = set()
            return super().visit_dataflow_block_(block)

        def visit_binding_block_(self, block):
            self.flat = set()
            return super().visit_binding_block_(block)

        def _flat_of(self, expr):
            """The 2-D var behind `expr` when it is our reshape of one."""
            if not isinstance(expr, relax.Var):
                return None
            value = self.lookup_binding(expr)
            if isinstance(value, relax.Call) and value.op == reshape and value.args[0] in self.flat:
                return value.args[0]
            return None

        def _rows(self, x, shape):
            """`x` as a [rows, K] GEMM operand: the 2-D var behind it where it
            is one of ours (a bottleneck's output feeding the next 1x1
            convolution), else a reshape."""
            flat = self._flat_of(x)
            if flat is not None and static_shape(flat) == shape:
                return flat
            value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
            if isinstance(value, relax.Call) and value.op == reshape:  # a view of a view: one reshape
                x = value.args[0]
            return self.builder_.emit(op.reshape(x, shape))

        def _emit_flat(self, call, shape):
            flat = self.builder_.emit(call)
            self.flat.add(flat)
            return op.reshape(flat, shape)

        def visit_call_(self, call):
            call = self.builder_.normalize(super().visit_call_(call))
            if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
                return call
            name = call.op.name
            if name == "relax.nn.conv2d" and convs and implicit_gemm.applies(
                    call, tf32, strided_1x1=gemms or conv1x1, pad=wgmma and not tf32 and _kernel_takes_padded(call)):
                return self._implicit(call)
            if name == "relax.nn.conv2d" and (gemms or conv1x1):
                return self._conv1x1(call, per_image=gemms)
            if name == "relax.matmul" and (gemms or pad_rows or wgmma):
                return self._matmul(call, every=gemms)
            if name == "relax.reshape":
                return self._reshape(call)
            if name in UNARY:
                src = self._flat_of(call.args[0])
                if src is None:
                    return call
                return self._emit_flat(relax.Call(call.op, [src, *call.args[1:]], call.attrs), static_shape(call))
            if name in BINARY:
                return self._binary(call)
            return call

        def _reshape(self, call):
            """A 2-D [rows, K] tensor viewed as [..., K] (a dense layer's output
            split back into batch and sequence): that 2-D tensor is where the
            epilogue that follows is carried. A reshape of such a view back to
            its 2-D shape is the 2-D tensor itself."""
            x = call.args[0]
            src = self._flat_of(x)
            if src is not None and static_shape(src) == static_shape(call):
                return src
            xs, ys = static_shape(x), static_shape(call)
            if isinstance(x, relax.Var) and xs is not None and ys is not None and len(xs) == 2 and len(ys) > 2 \
                    and ys[-1] == xs[1] and math.prod(ys[:-1]) == xs[0]:
                self.flat.add(x)
            return call

        def _conv1x1(self, call, per_image: bool):
            """A 1x1 convolution as a 2-D GEMM; one of a 1x1 map (a GEMM of a
            row an image: squeeze-excitation's) only with `per_image` (the
            `gemms` of the profile's flat_gemm). As a convolution its
            consumer's gating multiply, which broadcasts over the feature map,
            fuses into its kernel (rule broadcast-epilogue); as a GEMM it did
            not, and EfficientNet-B0 at batch 32 ran 16% slower than without
            the default's GEMMs (results/h100/2026-12-06/depthwise-b32/)."""
            a = call.attrs
            if not implicit_gemm.dense_nhwc(a) or not implicit_gemm.stride_1_unpadded(a):
                return call
            x, w = call.args
            xs, ws, ys = static_shape(x), static_shape(w), static_shape(call)
            if xs is None or ws is None or ys is None or ws[1:3] != [1, 1] or (ys[1:3] == [1, 1] and not per_image):
                return call
            n, h, wd, c = xs
            o = ws[0]
            lhs = self._rows(x, [n * h * wd, c])
            rhs = self.builder_.emit(op.permute_dims(op.reshape(w, [o, c]), [1, 0]))  # folded for constant weights
            return self._emit_flat(op.matmul(lhs, rhs, out_dtype=a.out_dtype), ys)

        def _implicit(self, call):
            a = call.attrs
            x, w = call.args
            o, r, s, c = static_shape(w)
            ys = static_shape(call)
            strides, padding = a.strides, a.padding
            blocked = implicit_gemm.space_to_depth(static_shape(x), (o, r, s, c), strides, padding, ys)
            if blocked is not None:  # (2 x 2 blocks of pixels as channels: the data's blocking fused upstream)
                def blocks(t, name):  # padded, [.., P, 2, Q, 2, C] -> [.., P, Q, 2, 2, C] -> [.., P, Q, 4C]
                    split, merged = blocked[f"{name}_blocks"]
                    six = op.reshape(op.nn.pad(t, blocked[f"{name}_pad"]), split)
                    return self.builder_.emit(op.reshape(op.permute_dims(six, [0, 1, 3, 2, 4, 5]), merged))

                x, w = blocks(x, "x"), blocks(w, "w")  # (the weights' folded)
                (r, s), c = blocked["kernel"], 4 * blocked["channels"]
                strides, padding = [1, 1], [0, 0, 0, 0]
            elif c % implicit_gemm.VECTOR:  # (too few channels: both padded with zeros, the data's pad fused upstream)
                pad = [0] * 7 + [implicit_gemm.padded_channels(c) - c]
                x, w = self.builder_.emit(op.nn.pad(x, pad)), self.builder_.emit(op.nn.pad(w, pad))
                c = implicit_gemm.padded_channels(c)
            w2 = self.builder_.emit(op.reshape(w, [o, r * s * c]))  # (folded for constant weights)
            gemm = self.builder_.call_te(implicit_gemm.conv_as_gemm, x, w2, kernel=(r, s), strides=strides,
                                         padding=padding, out_shape=ys, out_dtype=tensor_dtype(call),
                                         primfunc_name_hint="conv2d_gemm")
            return self._emit_flat(gemm, ys)

        def _matmul(self, call, every: bool):
            """Every N-D matmul by a 2-D right side, or (not `every`) those
            pad_rows and wgmma ask for."""
            x, w = call.args
            xs, ws, ys = static_shape(x), static_shape(w), static_shape(call)
            if xs is None or ws is None or ys is None or len(xs) < 3 or len(ws) != 2:
                return call
            rows = math.prod(xs[:-1])
            kernel = wgmma and wgmma_gemm.fits(rows, ws[1], xs[-1]) and tensor_dtype(x) == tensor_dtype(w) == "float16" \
                and tensor_dtype(call) == "float32"  # (the kernel sums in fp32, not as accumulate = "fp16" asks)
            if not every and not (pad_rows and pads(rows)) and not kernel:
                return call
            lhs = self._rows(x, [rows, xs[-1]])
            return self._emit_flat(op.matmul(lhs, w, out_dtype=call.attrs.out_dtype), ys)

        def _binary(self, call):
            lhs, rhs = call.args
            ys = static_shape(call)
            flat_l, flat_r = self._flat_of(lhs), self._flat_of(rhs)
            if ys is None or (flat_l is None and flat_r is None):
                return call
            rows, cols = static_shape(flat_l if flat_l is not None else flat_r)
            # Decide for both sides before emitting anything: a flat side the
            # other broadcasts over (squeeze-excitation's [N,1,1,C] scale of a
            # feature map) is not elementwise over the rows.
            plan = []
            for arg, flat in ((lhs, flat_l), (rhs, flat_r)):
                s = static_shape(arg)
                if flat is not None:
                    if s != ys or static_shape(flat) != [rows, cols]:
                        return call  # (two views of different 2-D shapes: left as they are)
                    plan.append(("as is", flat))
                elif s is None:
                    return call
                elif s == ys:  # a residual: viewed in 2-D as well
                    plan.append(("rows", arg))
                elif len(s) <= len(ys) and all(d == 1 for d in s[:-1]) and (not s or s[-1] in (1, cols)):
                    plan.append(("bias", arg) if s else ("as is", arg))  # a bias; a scalar
                else:
                    return call
            args = [x if how == "as is" else self.builder_.emit(
                op.reshape(x, [rows, cols] if how == "rows" else [1, static_shape(x)[-1]])) for how, x in plan]
            return self._emit_flat(relax.Call(call.op, args, call.attrs), ys)

    def _kernel_takes_padded(call) -> bool:
        """Whether the wgmma kernel takes this convolution's implicit GEMM
        with its channels padded to 8 (elsewhere, K = 7 x 7 x 8 being no
        multiple of 16, it would fall to DLight with 2.7 times the
        products)."""
        xs, ws, ys = static_shape(call.args[0]), static_shape(call.args[1]), static_shape(call)
        if xs is None or ws is None or ys is None or len(ys) != 4 or len(ws) != 4:
            return False
        o, r, s, c = ws
        blocked = implicit_gemm.space_to_depth(xs, ws, call.attrs.strides, call.attrs.padding, ys)
        if blocked is not None:
            return wgmma_gemm.takes(ys[0] * ys[1] * ys[2], o, blocked["k"])
        return wgmma_gemm.takes(ys[0] * ys[1] * ys[2], o, r * s * implicit_gemm.padded_channels(c))

    # The 4-D views nothing reads any more go: a dead consumer of the GEMM
    # would keep FuseOps from fusing its epilogue (no single post-dominator).
    return pruned("FlatGemm", relax_function_pass("FlatGemm", FlatGemm, emits_functions=convs))


def flat_epilogues(pad_rows: bool = False, convs: bool = False, tf32: bool = False, wgmma: bool = False,
                   conv1x1: bool = False):
    """The elementwise epilogue of a 2-D matmul whose output is reshaped to
    more dimensions (a transformer's dense layer over batch x sequence rows,
    then GELU, a residual add) carried in 2-D, and the reshape back to 2-D
    that follows removed: FuseOps then puts the epilogue into the matmul's
    kernel (ViT-S/16: GELU ran as a kernel of its own between two reshapes,
    6 x 27 us at batch 32 on the H200). On by default; `flat_gemm()` does
    this too. With `pad_rows` (the profile's `pad_gemm`), N-D matmuls whose
    rows passes.pad_gemm pads become 2-D GEMMs as well (ViT-S/16's attention
    output projection over 32 x 197 tokens). With `convs` (the profile's
    `implicit_gemm`), KxK convolutions become implicit GEMMs as well. With
    `wgmma` (passes.wgmma_gemm's kernel in use), N-D matmuls whose 2-D form
    the kernel takes become 2-D GEMMs (GPT's dense layers over batch x
    sequence rows: the kernel takes 2-D GEMMs only). With `conv1x1`, 1x1
    convolutions become 2-D GEMMs (strided ones implicit GEMMs with `convs`),
    as `flat_gemm()` makes them (the profile's default `implicit_gemm` on
    sm_90: config.Profile.implicit_gemms)."""
    return flat_gemm(gemms=False, pad_rows=pad_rows, convs=convs, tf32=tf32, wgmma=wgmma, conv1x1=conv1x1)
