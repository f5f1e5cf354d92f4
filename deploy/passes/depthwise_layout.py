"""Depthwise convolutions' weights with the channel innermost (HWOI), and
grouped convolutions' with the output channel innermost (HWIO).

Our own Relax pass (not a workaround of a defect). After ConvertLayout an
NHWC depthwise convolution keeps its weight in OHWI, [C, kh, kw, 1]: the
channel is the outermost axis, so the kh*kw taps of one channel are
contiguous and those of neighbouring channels kh*kw elements apart. Every
GPU schedule of it (DLight's, our ShortReduction, MetaSchedule's) gives
neighbouring threads neighbouring channels of one output pixel, as the NHWC
activations are laid out: each warp's load of one tap of the weight then
spans 32 x kh*kw elements (50 bytes apart for a 5x5 fp16 kernel, 50 sectors
per request, against 2 for the activations'). On the H200 EfficientNet-B0's
depthwise convolutions at batch 32 ran at 3-10% of their memory roofline,
and were a third of its kernel time
(results/h200/2026-12-03/efficientnet_b0-fp16-b32-excite/profile.md).

The pass gives each such convolution the weight `permute_dims(w, [1, 2, 0,
3])` and `kernel_layout="HWOI"`: TOPI's convolution takes any kernel
layout, and the weights are constants, so FoldConstant permutes them once at
build time. Scope: 2-D NHWC/OHWI convolutions whose groups equal their input
channels with one input channel per group; every other convolution is left
as it is.

A grouped convolution (ResNeXt's 32 groups of 4 to 32 channels) has the
same trouble: our ShortReduction gives it a thread an output
(passes/gpu_default.py), neighbouring threads neighbouring output channels,
and its OHWI weight puts those kh*kw*I elements apart (ResNeXt-50's at
batch 64 on an H100: 0-4% of their roofline, 87% of the kernels' time;
results/h100/2026-12-06/grouped-and-b32/). It gets `permute_dims(w, [1,
2, 3, 0])` and `kernel_layout="HWIO"`: a warp's 32 output channels read 64
contiguous bytes of each tap (only those ShortReduction takes: a window
larger than 1x1, up to MAX_GROUPED_TAPS steps; not yet timed on a GPU).
"""

from __future__ import annotations

from . import nhwc_ohwi, relax_function_pass
from .gpu_default import MAX_GROUPED_TAPS


def depthwise_channels_last():
    """A pass: NHWC/OHWI depthwise conv2d -> NHWC/HWOI, grouped -> NHWC/HWIO
    (see the module)."""
    from ..tvm_compat import relax, tvm

    op = relax.op
    conv2d = tvm.ir.Op.get("relax.nn.conv2d")

    @relax.expr_functor.mutator
    class ChannelsLast(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call, relax.Call) or call.op != conv2d:
                return call
            a = call.attrs
            if not nhwc_ohwi(a):
                return call
            x, w = call.args
            try:  # static channel counts only (TVM 0.27: struct info is `.ty`)
                c, kh, kw, i = int(x.ty.shape[3]), int(w.ty.shape[1]), int(w.ty.shape[2]), int(w.ty.shape[3])
            except (TypeError, ValueError, AttributeError, IndexError):
                return call
            groups = int(a.groups)
            if groups == c and i == 1 and c != 1:  # depthwise
                axes, layout = [1, 2, 0, 3], "HWOI"
            elif 1 < groups < c and groups * i == c and 1 < kh * kw and kh * kw * i <= MAX_GROUPED_TAPS:  # (grouped)
                axes, layout = [1, 2, 3, 0], "HWIO"
            else:
                return call
            w_new = self.builder_.emit(op.permute_dims(w, axes))
            return op.nn.conv2d(x, w_new, strides=a.strides, padding=a.padding, dilation=a.dilation,
                                groups=a.groups, data_layout="NHWC", kernel_layout=layout, out_layout="NHWC",
                                out_dtype=a.out_dtype)

    return relax_function_pass("DepthwiseChannelsLast", ChannelsLast)
