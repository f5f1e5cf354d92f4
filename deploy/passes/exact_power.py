"""Workaround: TVM 0.27 compiles CUDA with fast math, where `x ** 2` of a
negative x is NaN.

Upstream symptom (TVM 0.27, CUDA): TOPI lowers `power(x, 2.0)` to
`powf(x, 2.0f)`, and TVM's NVRTC path always passes `--use_fast_math`
(`tvm/support/nvcc.py`; its nvcc path too unless TVM_CUDA_NVCC_NO_FAST_MATH),
which turns `powf` into `exp2(y * log2(x))`: NaN for every negative x. A
decoder's RMSNorm (`x.pow(2).mean(-1)`) then makes every logit NaN on the H200
(the corpus's `gpt`, fp32 and fp16: "128000 non-finite values"), while the
same package validates on llvm.

Scope: only `power` with a constant scalar exponent of 1, 2, 3 or 4, rewritten
to multiplications (exact, and no slower). Other exponents are left to `powf`.
`tests/passes/test_passes.py` checks that TVM still lowers `power(x, 2)` to `powf`,
and fails once it does not (then this can go).
"""

from __future__ import annotations

from . import relax_function_pass

EXPONENTS = (1.0, 2.0, 3.0, 4.0)


def power_to_multiply():
    from ..tvm_compat import RelaxConstant, relax, tvm

    power = tvm.ir.Op.get("relax.power")

    @relax.expr_functor.mutator
    class Rewrite(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if call.op != power or not isinstance(call.args[1], RelaxConstant):
                return call
            e = call.args[1].value.numpy()
            if e.size != 1 or float(e.reshape(())) not in EXPONENTS:
                return call
            x = call.args[0]
            if not isinstance(x.ty, relax.TensorType) or call.ty.dtype != x.ty.dtype:
                return call
            n = int(float(e.reshape(())))
            out = x
            for _ in range(n - 1):
                out = relax.op.multiply(out, x)
            return out

    return relax_function_pass("PowerToMultiply", Rewrite)
