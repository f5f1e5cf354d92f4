"""deploy/passes/conv1d.py: a stack of 1-D convolutions becomes 2-D ones of
height 1 that meet 4-D (no squeeze and expand_dims between them), computes
what it computed, and the CPU's optimize stage then blocks its channels."""

from __future__ import annotations

import numpy as np
import pytest

from deploy.passes import conv1d
from deploy.tvm_compat import relax, tensor, tvm


def _stack(layers=((10, 5, 0), (3, 2, 1), (2, 2, 0)), channels: int = 8, groups: int = 1, head: str = "mean"):
    """main(x[1, 1, 400]): conv1d -> + bias [C, 1] -> GELU, per (kernel,
    stride, padding) layer, then `head` ("mean" over time, or "none")."""
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 1 if groups == 1 else channels, 400], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h, inp = x, 1 if groups == 1 else channels
            for k, s, p in layers:
                w = relax.const(rng.standard_normal((channels, inp // groups, k)).astype("float32"))
                h = bb.emit(relax.op.nn.conv1d(h, w, strides=s, padding=p, groups=groups))
                h = bb.emit(relax.op.add(h, relax.const(rng.standard_normal((channels, 1)).astype("float32"))))
                h = bb.emit(relax.op.nn.gelu(h))
                inp = channels
            out = bb.emit_output(relax.op.mean(h, axis=[2]) if head == "mean" else h)
        bb.emit_func_output(out)
    return bb.get()


def _ops(mod) -> list[str]:
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            names.append(expr.op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return names


def _rewritten(mod):
    T = relax.transform
    return tvm.transform.Sequential([conv1d.conv1d_as_conv2d(), T.CanonicalizeBindings(),
                                     T.DeadCodeElimination()])(mod)


def _run(mod, x):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tensor(x, tvm.cpu())).numpy()


@pytest.mark.parametrize("groups,head", [(1, "mean"), (8, "none")])
def test_a_stack_of_conv1d_meets_4d_and_computes_the_same(groups, head):
    mod = _stack(groups=groups, head=head)
    new = _rewritten(mod)
    ops = _ops(new)
    assert "relax.nn.conv1d" not in ops and ops.count("relax.nn.conv2d") == 3
    # one squeeze, before the head; no expand_dims: the convolutions, bias and GELU all 4-D
    assert ops.count("relax.squeeze") == 1 and "relax.expand_dims" not in ops
    x = np.random.default_rng(1).standard_normal([int(d) for d in mod["main"].params[0].ty.shape]).astype("float32")
    np.testing.assert_allclose(_run(new, x), _run(mod, x), rtol=1e-5, atol=1e-5)


def test_a_consumer_that_is_not_elementwise_keeps_the_squeeze_before_it():
    """The mean over time reads the 3-D tensor: the squeeze stays before it."""
    new = _rewritten(_stack(layers=((3, 1, 1),)))
    ops = _ops(new)
    assert ops.index("relax.squeeze") < ops.index("relax.mean")


def test_off_it_leaves_conv1d_alone(monkeypatch):
    monkeypatch.setattr(conv1d, "ENABLED", False)
    ops = _ops(_rewritten(_stack()))
    assert ops.count("relax.nn.conv1d") == 3 and "relax.nn.conv2d" not in ops


def test_the_cpu_optimize_stage_blocks_the_channels(llvm_target):
    """Through the CPU's optimize phases: every convolution in NCHWc, no
    layout transform between two of them."""
    from deploy import config, optimize

    profile = config.from_dict({"model": {"source": "wav_conv1d"}}).llvm
    out, _ = optimize.optimize_module(_stack(channels=32), profile, llvm_target.tvm_target())
    kernels = [gv.name_hint for gv, f in out.functions_items() if not isinstance(f, relax.Function)]
    convs = [k for k in kernels if "conv2d_NCHWc" in k]
    assert len(convs) == 3 and not any("conv1d" in k for k in kernels)
    assert sum("layout_transform" in k for k in kernels) <= 2  # into the blocked layout and out of it
