"""1-D convolutions as 2-D ones of height 1, with the elementwise ops between
them kept 4-D, so that the CPU's blocked layout takes a whole stack of them
(the CPU profile only: it runs before the NCHWc layout phase).

`passes/nchwc.py` blocks the channels of 2-D convolutions; a `conv1d` stays
NCW, and the CPU's default schedule then vectorizes it along its output
positions. Raw audio's strided convolutions (`wav_conv1d`, wav2vec 2.0's
feature encoder: stride 2 over 1,599 samples into 799) read their input
two floats apart along that vector and ran at 5 GFLOP/s: the model took
10-11x ONNX Runtime's time (results/cpu/2026-12-07/corpus-llvm-pad/).

- `conv1d` (NCW data, OIW weights, static shapes) becomes a reshape to
  [N, C, 1, W], `conv2d` with [O, I, 1, K] weights (height stride 1, no
  height padding), and `squeeze`: the same sum, any stride, padding,
  dilation and groups, its `out_dtype` kept.
- A squeeze's elementwise consumers (the bias and scale a BatchNorm leaves,
  GELU) run on the 4-D tensor instead, their other operands reshaped to 4-D
  too (ConvertLayout blocks a binary op only where its operands have one
  rank), and the squeeze moves after them; an `expand_dims` or a
  convolution's reshape that undoes a squeeze takes the 4-D tensor. Consecutive convolutions then meet 4-D,
  and ConvertLayout carries NCHW16c from one to the next, instead of
  wrapping a squeeze and an expand_dims between them in layout transforms:
  with the rewrite alone, the convolutions ran 5-9x faster but those
  transforms, fused into the GELU kernels, took the model from 62 to 384 ms.

Elementwise here: TVM's broadcasting unary and binary operators listed in
ELEMENTWISE (anything else stops the squeeze, which stays where it is).
"""

from __future__ import annotations

from . import relax_function_pass, static_shape

ENABLED = True
ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum",
    "relax.power", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu", "relax.nn.silu", "relax.sigmoid",
    "relax.tanh", "relax.erf", "relax.exp", "relax.sqrt", "relax.rsqrt", "relax.negative", "relax.clip",
    "relax.astype",
})


def conv1d_as_conv2d():
    """The pass (a module pass over every Relax function)."""
    from ..tvm_compat import relax, tvm

    op = relax.op
    conv1d = tvm.ir.Op.get("relax.nn.conv1d")
    squeeze, expand = tvm.ir.Op.get("relax.squeeze"), tvm.ir.Op.get("relax.expand_dims")

    @relax.expr_functor.mutator
    class Conv1dAsConv2d(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.flat = {}  # a squeeze's result -> (its 4-D source, the axis it removed); within one block

        def visit_dataflow_block_(self, block):
            self.flat = {}
            return super().visit_dataflow_block_(block)

        def visit_binding_block_(self, block):
            self.flat = {}
            return super().visit_binding_block_(block)

        def visit_var_binding_(self, binding):
            value = self.visit_expr(binding.value)
            if ENABLED and isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                new = self._rewrite(value)
                if new is not None:
                    value = new
            # (the binding keeps its variable: the rewrites keep its shape and dtype)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))
            flat = self._squeezed(value)
            if flat is not None:
                self.flat[binding.var] = flat

        def _squeezed(self, value):
            """(4-D source, axis) where `value` is a one-axis squeeze of a unit axis."""
            if isinstance(value, relax.Call) and value.op == squeeze and value.attrs.axis is not None \
                    and len(value.attrs.axis) == 1:
                shape = static_shape(value.args[0])
                axis = int(value.attrs.axis[0])
                if shape is not None and 0 <= axis < len(shape) and shape[axis] == 1:
                    return value.args[0], axis
            return None

        def _rewrite(self, call):
            if call.op == conv1d:
                return self._conv(call)
            if call.op == expand and len(call.args) == 1 and call.args[0] in self.flat:
                source, axis = self.flat[call.args[0]]
                if [int(a) for a in call.attrs.axis] == [axis]:
                    return source
                return None
            if call.op.name in ELEMENTWISE:
                return self._sink(call)
            return None

        def _conv(self, call):
            attrs = call.attrs
            x, w = call.args
            if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout or "NCW")) != ("NCW", "OIW", "NCW") \
                    or static_shape(x) is None or static_shape(w) is None:
                return None
            (stride,), (dilation,) = [int(s) for s in attrs.strides], [int(d) for d in attrs.dilation]
            left, right = (int(p) for p in attrs.padding)
            out_dtype = str(attrs.out_dtype or "")
            flat = self.flat.get(x)
            x4 = flat[0] if flat is not None and flat[1] == 2 else self.builder_.emit(_with_unit(x, 2))
            y = self.builder_.emit(op.nn.conv2d(
                x4, self.builder_.emit(_with_unit(w, 2)),
                strides=(1, stride), padding=(0, left, 0, right), dilation=(1, dilation), groups=int(attrs.groups),
                out_dtype=out_dtype if out_dtype not in ("", "void") else None))
            return op.squeeze(y, [2])

        def _sink(self, call):
            """The elementwise op on the 4-D tensor, squeezed after it."""
            flat = [self.flat.get(a) for a in call.args]
            if not any(flat):
                return None
            axes = {f[1] for f in flat if f is not None}
            rank = len(static_shape(call) or [])
            if len(axes) != 1 or not rank:
                return None
            axis = axes.pop()
            args = []
            for a, f in zip(call.args, flat):
                if f is not None:
                    args.append(f[0])
                    continue
                shape = static_shape(a)
                if shape is None:
                    return None
                if not shape:  # a scalar broadcasts as it is
                    args.append(a)
                    continue
                # right-aligned to the full rank, then the unit axis: ConvertLayout carries the blocked
                # layout through a binary op only where both operands have the same rank ([C, 1] -> [1, C, 1, 1])
                args.append(self.builder_.emit(_with_unit(a, axis, rank)))
            wide = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
            return op.squeeze(wide, [axis])

    return relax_function_pass("Conv1dAsConv2d", Conv1dAsConv2d)


def _with_unit(x, axis: int, rank: int | None = None):
    """`x` with a unit axis at `axis`, as a reshape (fold_weights folds a
    constant's in NumPy; an expand_dims would be compiled to fold it); with
    `rank`, first right-aligned to that many axes (broadcasting's view)."""
    from ..tvm_compat import relax

    shape = static_shape(x)
    full = [1] * ((rank or len(shape)) - len(shape)) + shape
    return relax.op.reshape(x, [*full[:axis], 1, *full[axis:]])
