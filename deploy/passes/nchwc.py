"""The CPU's convolution layout, NCHW[x]c: channels blocked in 16s (one
AVX-512 vector of fp32; two AVX2 vectors), so that a convolution's
innermost loop is one SIMD vector of output
channels, fed by one broadcast input value and one contiguous vector of
prepacked weights (ONNX Runtime's MLAS and oneDNN do the same on x86).

`convert()` moves each 2-D convolution to NCHW{c}c data, OIHW{ci}i{co}o
weights and NCHW{co}c outputs, choosing the blocks per convolution from its
own channel counts (`blocks`): 16 where the channels allow it, 8 or 4
otherwise (passes/pad_channels.py first pads most counts that 16 does not
divide), fewer than 16 input channels (a first layer's 3) taken whole; a depthwise
convolution gets OIHW1i{c}o weights; a grouped one whose groups are whole
blocks of its tensors' block (ResNeXt's 16 and 32 channels a group) gets
OIHW{I/g}i{c}o weights (`GROUPED`), and one of 4 or 8 channels a group is
first widened to 16 with zero weights (`widen_groups`); other grouped
convolutions and channel counts no block divides stay in NCHW. ConvertLayout carries the blocked layout
through the elementwise ops and pooling between convolutions and transforms
back where an operator needs NCHW (a flatten, a softmax). Where TVM's
ConvertLayout fails on a model (0.27: a LayerNorm over the channels after a
spatial mean, ConvNeXt's head, gets its input's blocked axis; `mean` keeps
the block in its output's layout), the model keeps NCHW and
the log says so in one line. The weights'
layout transforms are constants, folded at compile time: the weights are
packed once, in the module.

Workaround (`legalize_conv2d`): TVM 0.27's legalization of `relax.nn.conv2d`
refuses a layout with a channel block ("Conv2D where data layout or kernel
layout have channel chunk cannot be legalized by TOPI at this moment"), and
the operator then reaches VM codegen and fails the build. Scoped to
convolutions with a blocked layout: those become TOPI's `conv2d_NCHWc`, or
for a depthwise one our own compute below (TOPI's generic
`depthwise_conv2d_NCHWc` is only a declaration in 0.27), for a grouped one
ours too (TOPI has none); every other
convolution goes to TVM's own legalization. `tests/passes/test_nchwc.py`
fails once TVM legalizes a blocked conv2d itself.

Measured, ResNet-50 batch 1 on 2 cores (x86-64-v4), untuned, the default CPU
schedules: NCHW 58.0 ms, NCHWc 27.5 ms (ONNX Runtime 21.6 ms); the corpus:
`results/cpu/2026-12-03/corpus-llvm-nchwc/` (README one folder up).
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

# Grouped convolutions in NCHWc where their groups are whole blocks. ResNeXt's stage-3/4 ones (NCHW, vectorized
# over 7 or 14 output columns, stride 2 a gather) 2-7x faster: results/cpu/2026-12-07/grouped/.
GROUPED = True
WIDEN_GROUPS = True  # (`widen_groups`: ResNeXt's 4- and 8-channel groups; its package 0.85-0.91x the time)
BLOCKS = (16, 8, 4)  # channel blocks tried, largest first (16 fp32 lanes fill an AVX-512 vector)


def _channel_block(channels: int, whole_below: int = 0) -> int | None:
    """The largest of BLOCKS dividing `channels`; `channels` itself when it is
    below `whole_below` (a first layer's 3 channels); else None."""
    for b in BLOCKS:
        if channels % b == 0:
            return b
    return channels if channels < whole_below else None


def blocks(in_channels: int, out_channels: int, groups: int) -> tuple[str, str, str] | None:
    """(data, weight, output) layouts of one NCHW/OIHW convolution, or None
    where it stays as it is."""
    if groups == 1:
        ci, co = _channel_block(in_channels, whole_below=BLOCKS[0]), _channel_block(out_channels)
        if ci is None or co is None:
            return None
        return f"NCHW{ci}c", f"OIHW{ci}i{co}o", f"NCHW{co}c"
    if groups == in_channels == out_channels:  # depthwise
        c = _channel_block(in_channels)
        return None if c is None else (f"NCHW{c}c", f"OIHW1i{c}o", f"NCHW{c}c")
    if GROUPED and groups > 1 and in_channels % groups == 0 and out_channels % groups == 0:
        # (the block its tensors get elsewhere, and one that divides each group's channels: TVM 0.27's
        # ConvertLayout cannot move a tensor from one channel block to another, "Invalid layout axis 16b")
        per_in, per_out = in_channels // groups, out_channels // groups
        c = _channel_block(in_channels)
        if c is None or c != _channel_block(out_channels) or per_in % c or per_out % c:
            return None
        return f"NCHW{c}c", f"OIHW{per_in}i{c}o", f"NCHW{c}c"
    return None


# conv2d_transpose stays in NCHW/IOHW, the one layout TOPI lowers (see passes.layout).
KEEP = {"relax.nn.conv2d": ["NCHW", "OIHW"], "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}


def _layouts(call) -> dict:
    from ..tvm_compat import relax

    if call.op.name != "relax.nn.conv2d":
        return KEEP
    a = call.attrs
    if a.data_layout != "NCHW" or a.kernel_layout != "OIHW" or a.out_layout != "NCHW":
        return KEEP
    data, weight = (arg.ty for arg in call.args)
    if not isinstance(data, relax.TensorType) or not isinstance(weight, relax.TensorType):
        return KEEP
    try:
        in_c, out_c = int(data.shape[1]), int(weight.shape[0])
    except (TypeError, AttributeError):  # a symbolic channel count
        return KEEP
    chosen = blocks(in_c, out_c, int(a.groups))
    return KEEP if chosen is None else {**KEEP, "relax.nn.conv2d": list(chosen)}


# What TVM's conv2d legalization logs (to the root logger, at INFO) each
# time a pass tries it on a blocked convolution (FoldConstant does, once per
# convolution): legalize_conv2d lowers those, so the lines are noise.
_TVM_REFUSALS = ("channel chunk cannot be legalized", "does not support different input-output layouts")


class _QuietTvmRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "root" and any(t in record.getMessage() for t in _TVM_REFUSALS))


def convert(prepare=()):
    """ConvertLayout with a per-convolution choice of blocks (`blocks`),
    after the passes `prepare` (padding channels, widening groups: work that
    only the blocked layout repays); a module TVM's ConvertLayout cannot
    convert keeps NCHW as it was before them (one log line)."""
    from ..tvm_compat import relax, tvm

    root = logging.getLogger()
    if not any(isinstance(f, _QuietTvmRefusals) for f in root.filters):
        root.addFilter(_QuietTvmRefusals())

    @tvm.transform.module_pass(opt_level=0, name="ConvertLayoutNCHWc")
    def run(mod, _ctx):
        if not _has_conv2d(mod):  # (nothing to convert; TVM's pass took 13 s over a GRU's 8,000 unrolled ops)
            return mod
        try:
            return relax.transform.ConvertLayout({}, _layouts)(tvm.transform.Sequential(list(prepare))(mod))
        except Exception as e:  # noqa: BLE001 - TVM raises ValueError, InternalError, ...
            log.warning("layout: convolutions stay in NCHW: TVM's ConvertLayout cannot move this model to NCHWc (%s)",
                        _one_line(e))
            return mod

    return run


def widen_groups():
    """A pass: a grouped convolution with fewer channels a group than a block
    of 16 (ResNeXt's first stages: 4 and 8) becomes one of 16 channels a
    group, its weights block-diagonal within each block (zeros between the
    old groups), so that `blocks` takes it in NCHW16c. It does 16 / (I/g)
    times the multiply-adds, each on a full vector with one broadcast input
    (in NCHW a gather at stride 2). Constant NCHW/OIHW weights with as many
    channels a group in as out only (`WIDEN_GROUPS`; not without `GROUPED`)."""
    import numpy as np

    from ..tvm_compat import RelaxConstant, relax, tvm
    from . import nchw_oihw, relax_function_pass, static_shape

    conv2d = tvm.ir.Op.get("relax.nn.conv2d")
    block = BLOCKS[0]

    @relax.expr_functor.mutator
    class Widen(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not (WIDEN_GROUPS and GROUPED) or not isinstance(call, relax.Call) or call.op != conv2d:
                return call
            a = call.attrs
            x, w = call.args
            shape, groups = static_shape(x), int(a.groups)
            if not nchw_oihw(a) or not isinstance(w, RelaxConstant) or shape is None or groups == 1:
                return call
            weight = w.value.numpy()
            out_c, per_group = weight.shape[:2]
            if out_c != shape[1] or out_c % block or block % per_group or per_group == 1 \
                    or out_c // groups != per_group:
                return call
            wide = np.zeros((out_c, block, *weight.shape[2:]), weight.dtype)
            for o in range(out_c):
                at = o % block // per_group * per_group
                wide[o, at:at + per_group] = weight[o]
            return relax.op.nn.conv2d(x, relax.const(wide, str(weight.dtype)), strides=a.strides, padding=a.padding,
                                      dilation=a.dilation, groups=out_c // block, data_layout="NCHW",
                                      kernel_layout="OIHW", out_layout="NCHW", out_dtype=a.out_dtype)

    return relax_function_pass("WidenGroups", Widen)


def _has_conv2d(mod) -> bool:
    from ..tvm_compat import relax, tvm

    conv = tvm.ir.Op.get("relax.nn.conv2d")
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                if any(isinstance(b.value, relax.Call) and b.value.op.same_as(conv) for b in block.bindings):
                    return True
    return False


def _one_line(e: Exception) -> str:
    """TVM's message, its operator's long repr cut to the operator's name."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    m = re.match(r'ir\.Op\(.*?name="([^"]+)".*support_level=\d+\)\s*(.*)', text)
    return (f"{m.group(1)} {m.group(2)}" if m else text)[:200]


def _is_blocked(layout: str) -> bool:
    return len(layout) != 4


def _out_dtype(attrs, data) -> str:
    text = str(attrs.out_dtype)
    return data.dtype if text in ("", "void", "None") else text


def _window(data, kh, kw, padding, strides, dilation):
    """(the blocked data padded, output rows, output columns) of a kh x kw window."""
    from ..tvm_compat import topi

    _, _, h, w, _ = data.shape
    (sh, sw), (dh, dw) = strides, dilation
    top, left, bottom, right = padding
    padded = topi.nn.pad(data, [0, 0, top, left, 0], [0, 0, bottom, right, 0], name="pad") \
        if any(int(p) for p in padding) else data
    return padded, (h + top + bottom - (kh - 1) * dh - 1) // sh + 1, (w + left + right - (kw - 1) * dw - 1) // sw + 1


def _depthwise_nchwc(data, weight, strides, padding, dilation, out_dtype):
    """[n, C/c, h, w, c] x [C/c, 1, kh, kw, 1, c] -> [n, C/c, oh, ow, c]."""
    from ..tvm_compat import te

    n, chunks, _, _, c = data.shape
    _, _, kh, kw, _, _ = weight.shape
    (sh, sw), (dh, dw) = strides, dilation
    padded, oh, ow = _window(data, kh, kw, padding, strides, dilation)
    rh, rw = te.reduce_axis((0, kh), name="rh"), te.reduce_axis((0, kw), name="rw")
    return te.compute(
        (n, chunks, oh, ow, c),
        lambda b, k, y, x, v: te.sum(
            padded[b, k, y * sh + rh * dh, x * sw + rw * dw, v].astype(out_dtype)
            * weight[k, 0, rh, rw, 0, v].astype(out_dtype),
            axis=[rh, rw],
        ),
        name="depthwise_conv2d_NCHWc",
    )


def _grouped_nchwc(data, weight, strides, padding, dilation, groups, out_dtype):
    """[n, C/c, h, w, c] x [O/c, 1, kh, kw, I/g, c] -> [n, O/c, oh, ow, c]: each
    block of c output channels lies within one group, and each of the
    group's I/g input channels is one value broadcast to the block."""
    from ..tvm_compat import te

    n, _, _, _, c = data.shape
    out_chunks, _, kh, kw, per_in, _ = weight.shape
    per_out = out_chunks * c // groups
    (sh, sw), (dh, dw) = strides, dilation
    padded, oh, ow = _window(data, kh, kw, padding, strides, dilation)
    ri = te.reduce_axis((0, per_in), name="ri")
    rh, rw = te.reduce_axis((0, kh), name="rh"), te.reduce_axis((0, kw), name="rw")

    def channel(k, r):  # the input channel r of output block k's group
        return k * c // per_out * per_in + r

    return te.compute(
        (n, out_chunks, oh, ow, c),
        lambda b, k, y, x, v: te.sum(
            padded[b, channel(k, ri) // c, y * sh + rh * dh, x * sw + rw * dw, channel(k, ri) % c].astype(out_dtype)
            * weight[k, 0, rh, rw, ri, v].astype(out_dtype),
            axis=[ri, rh, rw],
        ),
        name="group_conv2d_NCHWc",
    )


def legalize_conv2d(bb, call):
    """LegalizeOps' entry for `relax.nn.conv2d` (see the module docstring)."""
    from ..tvm_compat import topi, tvm

    a = call.attrs
    if not (_is_blocked(a.data_layout) or _is_blocked(a.kernel_layout)):
        return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)
    data, weight = call.args
    out_dtype = _out_dtype(a, data.ty)
    strides, padding, dilation = ([int(v) for v in x] for x in (a.strides, a.padding, a.dilation))
    if int(a.groups) == 1:
        return bb.call_te(topi.nn.conv2d_NCHWc, data, weight, strides, padding, dilation,
                          a.data_layout, a.out_layout, out_dtype, primfunc_name_hint="conv2d_NCHWc")
    if int(weight.ty.shape[4]) == 1 and int(a.groups) == int(data.ty.shape[1]) * int(data.ty.shape[4]):
        return bb.call_te(_depthwise_nchwc, data, weight, strides, padding, dilation, out_dtype,
                          primfunc_name_hint="depthwise_conv2d_NCHWc")
    return bb.call_te(_grouped_nchwc, data, weight, strides, padding, dilation, int(a.groups), out_dtype,
                      primfunc_name_hint="group_conv2d_NCHWc")
