"""Split-K for NHWC convolutions with few output rows and a long reduction.

Our own Relax pass (not a workaround of a defect): MetaSchedule's design
space has no split-K, and at batch 1 the last-stage convolutions of a ResNet
leave most of the H200's SMs idle. See `split_k_conv2d`.
"""

from __future__ import annotations

from . import nhwc_ohwi, relax_function_pass

# Which convolutions split_k_conv2d rewrites: at most this many output rows
# (batch x height x width) and at least this long a reduction.
SPLIT_K_MAX_ROWS = 256
SPLIT_K_MIN_K = 2048


def split_k_conv2d(parts: int, max_rows: int = SPLIT_K_MAX_ROWS, min_k: int = SPLIT_K_MIN_K):
    """A pass: each NHWC/OHWI convolution (groups 1, no dilation, static
    shapes) with at most `max_rows` output rows and a reduction of at least
    `min_k` (kh*kw*C, divisible by `parts` into multiples of 16) becomes
    im2col (pad, shifted windows, concat), a batched matmul over `parts`
    slices of the reduction, and a sum over them (three kernels after
    fusion: im2col; the matmul; the sum with the convolution's epilogue).

    Why: at batch 1, ResNet-50's last-stage 3x3 convolution is a GEMM of 49
    rows by 512 columns with K = 4608. A tensor-core schedule then has only a
    handful of thread blocks on 132 SMs, each walking 288 WMMA steps in a row
    (84 us on the H200, 2.7 TFLOP/s), and MetaSchedule's space has no split-K.
    Split in parts, the same work runs in `parts` times as many blocks with a
    reduction that many times shorter; the batched matmul still tensorizes
    (a grouped convolution, the other way to write it, does not)."""
    from ..tvm_compat import relax, tvm

    op = relax.op

    def ints(xs):
        return [int(x) for x in xs]

    @relax.expr_functor.mutator
    class SplitK(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.builder_.normalize(super().visit_call_(call))
            if not isinstance(call, relax.Call) or call.op != tvm.ir.Op.get("relax.nn.conv2d"):
                return call
            a = call.attrs
            if not nhwc_ohwi(a) or int(a.groups) != 1 \
                    or ints(a.dilation) != [1, 1]:
                return call
            x, w = call.args
            try:  # static shapes only
                xs, ws, ys = ([int(d) for d in e.ty.shape] for e in (x, w, call))  # TVM 0.27: struct info is `.ty`
            except (TypeError, ValueError, AttributeError):
                return call
            n, _, _, c = xs
            o, kh, kw, _ = ws
            _, ho, wo, _ = ys
            rows, k = n * ho * wo, kh * kw * c
            if rows > max_rows or k < min_k or k % parts or (k // parts) % 16:
                return call
            sh, sw = ints(a.strides)
            pt, pl, pb, pr = ints(a.padding)
            xp = x
            if pt or pl or pb or pr:
                xp = self.builder_.emit(op.nn.pad(x, [0, 0, pt, pb, pl, pr, 0, 0]))
            if kh == kw == 1 and sh == sw == 1:
                col = xp
            else:
                wins = [
                    self.builder_.emit(op.strided_slice(xp, axes=[1, 2], begin=[ry, rx],
                                                        end=[ry + (ho - 1) * sh + 1, rx + (wo - 1) * sw + 1],
                                                        strides=[sh, sw]))
                    for ry in range(kh) for rx in range(kw)
                ]
                col = self.builder_.emit(op.concat(wins, axis=3))  # K ordered (ry, rx, c), as OHWI's (kh, kw, i)
            lhs = op.permute_dims(op.reshape(col, [rows, parts, k // parts]), [1, 0, 2])
            rhs = op.reshape(op.permute_dims(op.reshape(w, [o, k]), [1, 0]), [parts, k // parts, o])
            y = self.builder_.emit(op.matmul(self.builder_.emit(lhs), self.builder_.emit(rhs), out_dtype=a.out_dtype))
            # The parts summed by adds, not by a sum: FuseOps never fuses a
            # reduction with what follows it, so sum and the convolution's
            # epilogue (cast, bias, ReLU) would be two kernels; slices and adds
            # are injective and elementwise, one kernel with the epilogue.
            acc = None
            for i in range(parts):
                part = op.reshape(op.strided_slice(y, axes=[0], begin=[i], end=[i + 1]), [n, ho, wo, o])
                acc = part if acc is None else op.add(acc, part)
            return acc

    return relax_function_pass("SplitKConv2d", SplitK)
