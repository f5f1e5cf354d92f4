"""Channel counts padded to whole SIMD blocks for the CPU's blocked layout.

Our own Relax pass (not a workaround of a defect), run on the CPU path just
before `nchwc.convert()`. The NCHW[x]c layout blocks a convolution's
channels by the largest of 16, 8 or 4 that divides them (passes/nchwc.py):
ShuffleNetV2's 116 channels get blocks of 4 (a quarter of an AVX-512
vector), its 232 blocks of 8, its 58 none (the convolution stays in NCHW),
SqueezeNet's 1000-class convolution blocks of 8. Those convolutions ran at
42-132 GFLOP/s where the 16-channel ones reach ~260
(results/cpu/2026-12-07/pad-channels/).

ONNX Runtime's NchwcTransformer does the same as this pass: a convolution's
output channels are rounded up to the block, the extra channels computed
from zero weights.

Here, where a channel count C is not a multiple of BLOCK (16) and rounding
it up to C' adds at most MAX_PAD of the channels:
- a 2-D convolution (groups 1) with constant OIHW weights gets C' output
  channels, its extra weight rows zero;
- a convolution reading C' channels gets zero weights for the extra ones
  (so whatever they hold adds nothing); a depthwise one gets C' groups;
- a convolution whose input is not padded and has C channels reads it
  padded with zeros (`nn.pad`, which fuses with the layout transform after it);
- the padding rides through what keeps channels apart: elementwise ops that
  map finite values to finite values, a bias or scale of C channels (padded
  with zeros; a divisor with ones), pooling, and means or sums over the spatial axes;
- wherever else the tensor goes (a concatenation, a reshape, a matmul, the
  output) it goes through `strided_slice` back to C channels.
Every padded value keeps its sliced twin; DeadCodeElimination drops the
twins nothing reads. It runs inside `nchwc.convert(prepare)`: where TVM's
ConvertLayout fails on a model, the model keeps NCHW without the padding. The result computes the same as the model (the extra
channels are never read with a nonzero weight) and the blocked layout then
takes blocks of 16 for every such convolution.
"""

from __future__ import annotations

import numpy as np

from . import nchw_oihw, relax_function_pass, static_shape
from .nchwc import BLOCKS

BLOCK = BLOCKS[0]  # one AVX-512 vector of fp32 (two AVX2 vectors)
MAX_PAD = 0.25  # padding at most this share of the channels (24 -> 32 is not padded)
ENABLED = True  # (False: the pass leaves every module as it is; for A/B measurements)

# Elementwise ops whose result is finite wherever their input is (a padded channel holds whatever
# the ops before made of zeros: finite, never read with a nonzero weight).
UNARY = {"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.silu", "relax.nn.gelu",
         "relax.nn.gelu_tanh", "relax.erf", "relax.negative", "relax.abs", "relax.nn.leakyrelu"}
BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum"}
POOLS = {"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"}
REDUCTIONS = {"relax.mean", "relax.sum", "relax.max"}


def padded(channels: int) -> int | None:
    """`channels` rounded up to BLOCK where it is not a multiple of it and the
    padding adds at most MAX_PAD of it; else None."""
    if channels < BLOCK or channels % BLOCK == 0:
        return None
    up = -(-channels // BLOCK) * BLOCK
    return up if up - channels <= MAX_PAD * channels else None


def pad_channels():
    """A pass: convolutions' channel counts padded to whole blocks (see the module)."""
    from ..tvm_compat import RelaxConstant, relax, tvm

    op = relax.op

    def width(expr) -> int:
        return static_shape(expr)[1]

    @relax.expr_functor.mutator
    class PadChannels(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.padded = {}  # a Var of the model -> (its padded twin, the real channel count)

        def visit_var_binding_(self, binding):
            value = binding.value
            new = None
            if ENABLED and isinstance(binding.var, relax.DataflowVar) and isinstance(value, relax.Call) \
                    and isinstance(value.op, tvm.ir.Op):
                new = self._rewrite(value)
            if new is None:
                super().visit_var_binding_(binding)
                return
            expr, channels = new
            if channels is None:  # (the same result, computed from padded operands)
                self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(expr)))
                return
            twin = self.builder_.emit(expr, binding.var.name + "_pad")
            self.padded[binding.var] = (twin, channels)
            self.set_var_remap(binding.var, self.builder_.emit(
                op.strided_slice(twin, axes=[1], begin=[0], end=[channels]), binding.var.name))

        def _arg(self, expr):
            """(padded twin, channels) of an argument, or None."""
            return self.padded.get(expr) if isinstance(expr, relax.Var) else None

        def _rewrite(self, call):
            """(expression, real channels or None), or None where the binding stays as it is."""
            name = call.op.name
            if name == "relax.nn.conv2d":
                return self._conv2d(call)
            if not call.args or self._arg(call.args[0]) is None and name not in BINARY:
                return None
            if name in UNARY:
                twin, c = self._arg(call.args[0])
                return relax.Call(call.op, [twin, *call.args[1:]], call.attrs), c
            if name in POOLS and str(call.attrs.layout) == "NCHW" and str(call.attrs.out_layout or "NCHW") == "NCHW":
                twin, c = self._arg(call.args[0])
                return relax.Call(call.op, [twin], call.attrs), c
            if name in REDUCTIONS:
                return self._reduction(call)
            if name in BINARY:
                return self._binary(call)
            return None

        def _reduction(self, call):
            twin, c = self._arg(call.args[0])
            rank = len(static_shape(twin))
            axes = call.attrs.axis
            if axes is None:
                return None
            axes = [int(a) % rank for a in axes]
            if any(a <= 1 for a in axes):  # (over the batch or the channels)
                return None
            return relax.Call(call.op, [twin], call.attrs), c

        def _binary(self, call):
            a, b = call.args
            pa, pb = self._arg(a), self._arg(b)
            if call.op.name == "relax.divide" and pb:  # (a divisor whose extra channels may be zero)
                return None
            if pa and pb:
                same = pa[1] == pb[1] and width(pa[0]) == width(pb[0])
                return (relax.Call(call.op, [pa[0], pb[0]], call.attrs), pa[1]) if same else None
            if not (pa or pb):
                return None
            (twin, c), other = (pa, b) if pa else (pb, a)
            rank, shape = len(static_shape(twin)), static_shape(other)
            if shape is None or len(shape) > rank:
                return None
            axis = len(shape) - (rank - 1)  # the other operand's axis that meets the channels
            if axis >= 0 and shape[axis] != 1:
                if shape[axis] != c or not isinstance(other, RelaxConstant):
                    return None
                fill = 1.0 if call.op.name == "relax.divide" else 0.0
                data = other.value.numpy()
                pad = [(0, 0)] * data.ndim
                pad[axis] = (0, width(twin) - c)
                other = relax.const(np.pad(data, pad, constant_values=fill), str(data.dtype))
            else:
                other = self.visit_expr(other)
            args = [twin, other] if pa else [other, twin]
            return relax.Call(call.op, args, call.attrs), c

        def _input(self, x, channels):
            """The convolution input's padded twin (made here, a zero `nn.pad`,
            where the channel count asks for it), or None."""
            twin = self._arg(x)
            if twin is not None:
                return twin[0]
            up = padded(channels)
            if up is None:
                return None
            made = self.builder_.emit(op.nn.pad(self.visit_expr(x), [0, 0, 0, up - channels, 0, 0, 0, 0]),
                                      x.name + "_pad" if isinstance(x, relax.Var) else "pad")
            if isinstance(x, relax.Var):
                self.padded[x] = (made, channels)
            return made

        def _conv2d(self, call):
            x, w = call.args
            a = call.attrs
            shape = static_shape(x)
            if not nchw_oihw(a) or not isinstance(w, RelaxConstant) or shape is None or len(shape) != 4:
                return None
            weight = w.value.numpy()
            out_c, per_group, groups = weight.shape[0], weight.shape[1], int(a.groups)
            in_c = shape[1]
            if groups == 1:
                x_pad = self._input(x, in_c)
                out_up = padded(out_c)
                if x_pad is None and out_up is None:
                    return None
                cin = width(x_pad) if x_pad is not None else in_c
                new = np.zeros((out_up or out_c, cin, *weight.shape[2:]), weight.dtype)
                new[:out_c, :in_c] = weight
                groups_new = 1
            elif groups == in_c == out_c and per_group == 1:  # depthwise
                x_pad = self._input(x, in_c)
                if x_pad is None:
                    return None
                out_up = width(x_pad)
                new = np.zeros((out_up, 1, *weight.shape[2:]), weight.dtype)
                new[:out_c] = weight
                groups_new = out_up
            else:
                return None
            conv = op.nn.conv2d(x_pad if x_pad is not None else self.visit_expr(x),
                                relax.const(new, str(weight.dtype)), strides=a.strides, padding=a.padding,
                                dilation=a.dilation, groups=groups_new, data_layout="NCHW", kernel_layout="OIHW",
                                out_layout="NCHW", out_dtype=a.out_dtype)
            return conv, (out_c if out_up else None)

    return relax_function_pass("PadChannels", PadChannels)
