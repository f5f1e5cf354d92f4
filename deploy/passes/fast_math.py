"""Transcendental functions as vectorizable approximations on the CPU.

LLVM turns a vectorized `exp` (and `tanh`, `erf`, a sigmoid's `exp`) into
one libm call per element: EfficientNet-B0's convolutions with a SiLU
epilogue ran at 1 to 30 GFLOP/s against ~250 for the same convolutions with
ReLU, and its untuned module took 4.2x ONNX Runtime's time, whose MLAS
kernels use vectorized approximations. TVM's `FastMathTransform` rewrites
exp, tanh, erf and softmax to TOPI's `fast_*` polynomial forms; sigmoid,
which it leaves alone, becomes 1 / (1 + fast_exp(-x)) here. Measured in fp32
over their whole range (`tests/passes/test_fast_math.py`): relative error at
most 4.1e-6 (exp), 3.4e-7 (tanh), 3.6e-7 (erf), well inside fp32
validation's 1e-4.

On by default on the `llvm` target (`fast_math` in `[llvm]`; `fast_math =
false` keeps libm); off on CUDA, whose exp is a hardware instruction.
Measured over the corpus: `results/cpu/2026-12-03/corpus-llvm-after/` (README one folder up).
"""

from __future__ import annotations

from . import call_rewrite_pass


def _fast_sigmoid(x):
    from ..tvm_compat import te, topi

    one = te.const(1, x.dtype)
    return topi.divide(one, topi.add(one, topi.fast_exp(topi.negative(x))))


def fast_math():
    from ..tvm_compat import Sequential, relax, tvm

    sigmoid = tvm.ir.Op.get("relax.sigmoid")

    def rewrite(builder, _mod, call):
        if call.op == sigmoid and str(call.args[0].ty.dtype) in ("float32", "float16"):
            return builder.call_te(_fast_sigmoid, call.args[0], primfunc_name_hint="fast_sigmoid")
        return None

    return Sequential([call_rewrite_pass("FastSigmoid", rewrite), relax.transform.FastMathTransform()],
                      name="FastMath")
