"""Transposed convolutions whose kernel equals their stride, as a GEMM and a depth-to-space.

Our own Relax pass (the NHWC layout phase, so the CUDA path; not a workaround
of a defect). TVM lowers `conv2d_transpose` through TOPI in NCHW/IOHW only
(passes/layout.py), as a direct convolution over the input dilated with
zeros, which no tensor-core rule schedules: U-Net's two 2x2 stride-2
upsamplings took 1.87 of its 6.48 ms in kernels at batch 32 on an H100, at 3%
and 6% of the fp16 roofline (`results/h100/2026-12-06/corpus-baselines/profiles-b32/unet/`).

Where the kernel equals the stride (no padding, no output padding, no
dilation, one group: each input pixel writes its own kh x kw block of
outputs, the blocks do not overlap) the operator is exactly

    g[n*h*w, (i, j, o)] = sum_c x[n, h, w, c] * W[c, o, i, j]        (a GEMM)
    y[n, h*kh + i, w*kw + j, o] = g[n*h*w, (i, j, o)]                  (depth to space)

so `conv_transpose_gemm()` rewrites it as `matmul(reshape(x_nhwc, [N*H*W,
C]), W'[C, kh*kw*O])`, its weights permuted and reshaped once (folded), and
a reshape / permute / reshape to the NHWC output, transposed back to the
NCHW the operator had (ConvertLayout's transposes around it then cancel:
passes/transposes.py). A per-channel bias added to the result (`add(y,
b[1, O, 1, 1])`, as the ONNX importer writes ConvTranspose's bias) is added
to the GEMM's columns instead, tiled kh*kw times, so that it joins the
GEMM's kernel as an epilogue and the depth to space stays pure movement
(FuseOps puts it into its consumer, U-Net's skip concatenation). The GEMM is
2-D, so the tensor-core GEMM rules (wgmma_gemm, mma_gemm) take it.

Left as they are: kernels other than the stride (4x4 of stride 2, a DCGAN's:
the blocks overlap), padding, output padding, dilation, groups, other
layouts, symbolic shapes. `ENABLED = False` turns the rewrite off (A/Bs:
scripts/gpu_ab.sh). Tests: tests/passes/test_conv_transpose.py.
"""

from __future__ import annotations

from . import relax_function_pass, static_shape, tensor_dtype

ENABLED = True


def _block_kernel(call) -> tuple[int, int] | None:
    """(kh, kw) where `call` is a conv2d_transpose this pass takes; else None."""
    a = call.attrs
    x, w = (static_shape(arg) for arg in call.args)
    if x is None or w is None or len(x) != 4 or len(w) != 4:
        return None
    if (a.data_layout, a.kernel_layout, str(a.out_layout or a.data_layout)) != ("NCHW", "IOHW", "NCHW"):
        return None
    kh, kw = w[2], w[3]
    if [int(s) for s in a.strides] != [kh, kw] or int(a.groups) != 1:
        return None
    if any(int(p) for p in a.padding) or any(int(p) for p in a.output_padding):
        return None
    if any(int(d) != 1 for d in a.dilation) or x[1] != w[0]:
        return None
    return kh, kw


def conv_transpose_gemm():
    """A pass: see the module's docstring."""
    from ..tvm_compat import relax, tvm

    op = relax.op
    permute = tvm.ir.Op.get("relax.permute_dims")

    @relax.expr_functor.mutator
    class ConvTransposeGemm(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            # The NHWC outputs this pass emitted -> (their GEMM, [N, H, W, kh, kw, O]),
            # within one block (a dataflow var must not leave its block).
            self.gemms = {}

        def visit_dataflow_block_(self, block):
            self.gemms = {}
            return super().visit_dataflow_block_(block)

        def visit_binding_block_(self, block):
            self.gemms = {}
            return super().visit_binding_block_(block)

        def visit_call_(self, call):
            call = self.builder_.normalize(super().visit_call_(call))
            if not ENABLED or not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
                return call
            if call.op.name == "relax.nn.conv2d_transpose":
                kernel = _block_kernel(call)
                return call if kernel is None else self._gemm(call, *kernel)
            if call.op.name == "relax.add":
                return self._bias(call)
            return call

        def _nhwc(self, x):
            """`x` (NCHW) in NHWC: the tensor ConvertLayout transposed where it is
            one (and in scope here: not a dataflow var of an earlier block)."""
            value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
            if isinstance(value, relax.Call) and value.op == permute and value.attrs.axes is not None \
                    and [int(a) for a in value.attrs.axes] == [0, 3, 1, 2] \
                    and (isinstance(x, relax.DataflowVar) or not isinstance(value.args[0], relax.DataflowVar)):
                return value.args[0]
            return self.builder_.emit(op.permute_dims(x, [0, 2, 3, 1]))

        def _gemm(self, call, kh, kw):
            x, w = call.args
            n, c, h, wd = static_shape(x)
            o = static_shape(w)[1]
            rows = self.builder_.emit(op.reshape(self._nhwc(x), [n * h * wd, c]))
            cols = self.builder_.emit(op.reshape(op.permute_dims(w, [0, 2, 3, 1]), [c, kh * kw * o]))
            out_dtype = str(call.attrs.out_dtype or "") or None
            gemm = self.builder_.emit(op.matmul(rows, cols, out_dtype=out_dtype))
            return self._to_space(gemm, [n, h, wd, kh, kw, o])

        def _to_space(self, gemm, dims):
            n, h, wd, kh, kw, o = dims
            blocks = self.builder_.emit(op.reshape(gemm, dims))
            rows = self.builder_.emit(op.permute_dims(blocks, [0, 1, 3, 2, 4, 5]))
            nhwc = self.builder_.emit(op.reshape(rows, [n, h * kh, wd * kw, o]))
            self.gemms[nhwc] = (gemm, dims)
            return op.permute_dims(nhwc, [0, 3, 1, 2])

        def _ours(self, expr):
            """(GEMM, dims) where `expr` is this pass's NCHW result; else None."""
            value = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
            if isinstance(value, relax.Call) and value.op == permute and value.args[0] in self.gemms:
                return self.gemms[value.args[0]]
            return None

        def _bias(self, call):
            """`add(ours, b)` with `b` one value a channel: added to the GEMM's columns."""
            for ours, bias in (call.args, call.args[::-1]):
                found = self._ours(ours)
                if found is None:
                    continue
                gemm, dims = found
                o = dims[-1]
                if static_shape(bias) not in ([1, o, 1, 1], [o, 1, 1]) or tensor_dtype(bias) != tensor_dtype(gemm):
                    return call
                tiled = op.tile(op.reshape(bias, [o]), [dims[3] * dims[4]])
                return self._to_space(self.builder_.emit(op.add(gemm, tiled)), dims)
            return call

    return relax_function_pass("ConvTransposeGemm", ConvTransposeGemm)
