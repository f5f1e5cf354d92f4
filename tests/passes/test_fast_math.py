"""deploy/passes/fast_math.py: the CPU's vectorizable exp, sigmoid, tanh,
erf and softmax stay within fp32 validation's tolerance by a wide margin."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy import config, optimize
from deploy.passes.fast_math import fast_math
from deploy.tvm_compat import relax, te, topi, tvm


@pytest.mark.parametrize("name,lo,hi,bound", [("fast_exp", -80, 80, 5e-6), ("fast_tanh", -10, 10, 1e-6),
                                             ("fast_erf", -6, 6, 1e-6)])
def test_topi_fast_functions_are_accurate_over_their_range(name, lo, hi, bound, llvm_target):
    x = te.placeholder((1 << 14,), "float32", "x")
    lib = tvm.compile(te.create_prim_func([x, getattr(topi, name)(x)]), target=llvm_target.tvm_target())
    a = np.linspace(lo, hi, 1 << 14).astype("float32")
    out = tvm.runtime.tensor(np.zeros_like(a))
    lib(tvm.runtime.tensor(a), out)
    exact = {"fast_exp": np.exp, "fast_tanh": np.tanh, "fast_erf": np.vectorize(math.erf)}[name](a.astype("float64"))
    rel = np.abs(out.numpy() - exact) / np.maximum(np.abs(exact), 1e-30)
    assert rel[np.abs(exact) > 1e-30].max() < bound


def _net():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.multiply(x, relax.op.sigmoid(x)))  # SiLU
            y = bb.emit(relax.op.add(relax.op.tanh(y), relax.op.exp(relax.op.negative(relax.op.abs(y)))))
            out = bb.emit_output(relax.op.nn.softmax(y, axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def test_fast_math_rewrites_and_computes_the_same(llvm_target):
    plain = _net()
    fast = fast_math()(plain)
    script = fast.script()
    assert "fast_sigmoid" in script and "fast_exp" in script and "fast_tanh" in script and "fast_softmax" in script
    assert "R.sigmoid(" not in script and "R.exp(" not in script
    x = np.random.default_rng(0).standard_normal((2, 64)).astype("float32") * 4
    outs = []
    for m in (plain, fast):
        ex = tvm.compile(relax.get_pipeline("zero")(m), target=llvm_target.tvm_target())
        outs.append(relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-7)


def test_on_for_the_cpu_off_for_cuda_and_a_config_can_turn_it_off():
    assert config.LLVM_DEFAULTS.fast_math and not config.CUDA_DEFAULTS.fast_math
    off = config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"fast_math": False}}).llvm
    assert "fast_math" not in [name for name, _ in optimize.phases(off)]
    assert "fast_math" in [name for name, _ in optimize.phases(config.LLVM_DEFAULTS)]
