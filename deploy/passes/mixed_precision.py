"""Workaround: TVM 0.27's ToMixedPrecision crashes on calls with non-tensor arguments.

Upstream symptom (TVM 0.27, `relax.transform.ToMixedPrecision`):
  `infer_amp_utils.cc: NTypeFrom: Check failed: (tensor) is false: Expected
  TensorType, but got R.Callable(...)` (or `... but got T.int64`)
The rewriter re-types the arguments of every call whose mixed-precision policy
is "never" (operators with no policy, `call_tir` among them) once an upstream
value became fp16, and computes a dtype for each argument, the non-tensor ones
too: the PrimFunc of a `call_tir`, a shape or a scalar. TVM's ONNX frontend
emits such calls itself (Clip with tensor bounds becomes `call_tir(maximum)` /
`call_tir(minimum)`: MobileNetV2's ReLU6), so a plain fp16 build of those
graphs fails.

Scope: only calls with a "never" policy and at least one non-tensor argument.
`pin` routes each float tensor argument of such a call through an `astype` to
its own dtype; ToMixedPrecision then casts at that `astype` (a "follow" op it
handles) and leaves the call's own arguments unchanged, so it never re-types
them. `unpin` removes every `astype` that is left casting to the dtype it
already has. `tests/passes/test_passes.py` checks that ToMixedPrecision alone still
fails on such a graph, and fails once TVM no longer needs this.
"""

from __future__ import annotations

from . import relax_function_pass

_KINDS = {0: "always", 1: "follow", 2: "never"}


def _policy(op) -> str:
    value = op.get_attr("TMixedPrecisionPolicy")
    return "never" if value is None else _KINDS.get(int(value), "never")


def _is_nested_tensor(ty) -> bool:
    from ..tvm_compat import relax

    if isinstance(ty, relax.TensorType):
        return True
    if isinstance(ty, relax.TupleType):
        return all(_is_nested_tensor(f) for f in ty.fields)
    return False


def to_mixed_precision(out_dtype: str):
    """ToMixedPrecision(out_dtype) between `pin` and `unpin`: a Sequential."""
    from ..tvm_compat import Sequential, relax

    return Sequential([pin(), relax.transform.ToMixedPrecision(out_dtype=out_dtype), unpin()],
                      name="ToMixedPrecisionGuarded")


def pin():
    from ..tvm_compat import RelaxConstant, relax, tvm

    @relax.expr_functor.mutator
    class Pin(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if not isinstance(call.op, tvm.ir.Op) or _policy(call.op) != "never":
                return call
            if all(_is_nested_tensor(a.ty) for a in call.args):
                return call
            args = [self._pin(a) if _is_nested_tensor(a.ty) else a for a in call.args]
            return relax.Call(call.op, args, call.attrs, call.ty_args)

        def _pin(self, arg):
            if isinstance(arg, relax.Tuple):
                return relax.Tuple([self._pin(f) for f in arg.fields])
            ty = arg.ty
            if isinstance(ty, relax.TensorType) and str(ty.dtype) in ("float16", "float32") and not isinstance(arg, RelaxConstant):
                return self.builder_.emit(relax.op.astype(arg, ty.dtype))
            return arg

    return relax_function_pass("PinNeverPolicyArgs", Pin)


def unpin():
    from ..tvm_compat import relax, tvm

    astype = tvm.ir.Op.get("relax.astype")

    @relax.expr_functor.mutator
    class Unpin(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op == astype and isinstance(call.args[0].ty, relax.TensorType) \
                    and str(call.args[0].ty.dtype) == str(call.attrs.dtype):
                return call.args[0]
            return call

    return relax_function_pass("RemoveNoOpAstype", Unpin)
