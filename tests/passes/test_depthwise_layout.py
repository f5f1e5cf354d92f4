"""Depthwise convolutions' weights with the channel innermost
(deploy.passes.depthwise_layout): the rewrite computes the same
convolution, is applied only to depthwise NHWC/OHWI convolutions, costs no
kernel at run time (the weights are constants, permuted once), and gives the
kernel weight reads along the channel, as its activations are read."""

from __future__ import annotations

import numpy as np
import pytest

from deploy.passes.depthwise_layout import depthwise_channels_last

from .test_split_k import _conv_module, _run


@pytest.mark.parametrize("c, o, k, stride, hw, extra", [
    (32, 32, 3, 1, 9, {}),
    (24, 24, 5, 2, 11, {}),
    (16, 16, 7, 1, 8, {"n": 2, "w": 5, "padding": (3, 2, 3, 1)}),  # ConvNeXt's 7x7; batch 2, not square
    (8, 16, 3, 1, 6, {}),  # a channel multiplier of 2: still one input channel per group
    (8, 24, 3, 1, 9, {"dilation": (2, 1), "strides": (2, 1)}),  # dilated, uneven strides, a multiplier of 3
    (32, 32, 3, 1, 7, {"dtype": "float16"}),  # fp16 in, fp32 sum (as after ToMixedPrecision)
])
def test_the_rewritten_depthwise_convolution_computes_the_same(c, o, k, stride, hw, extra):
    mod = _conv_module(c, o, k, stride, hw, groups=c, **extra)
    new = depthwise_channels_last()(mod)
    assert 'kernel_layout="HWOI"' in new.script() and "permute_dims" in new.script()
    rng = np.random.default_rng(0)
    dtype = extra.get("dtype", "float32")
    x = rng.standard_normal([int(d) for d in mod["main"].params[0].ty.shape]).astype(dtype)
    w = rng.standard_normal([int(d) for d in mod["main"].params[1].ty.shape]).astype(dtype)
    want, got = _run(mod, x, w), _run(new, x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c, o, k, stride, hw, groups", [
    (16, 16, 3, 1, 6, 4),  # 4 channels a group
    (32, 64, 3, 2, 9, 8),  # 4 in, 8 out a group, strided
    (64, 64, 3, 1, 7, 2),  # 32 channels a group
])
def test_the_rewritten_grouped_convolution_computes_the_same(c, o, k, stride, hw, groups):
    """A grouped convolution gets its weight HWIO (the output channel
    innermost) and computes the same."""
    mod = _conv_module(c, o, k, stride, hw, groups=groups)
    new = depthwise_channels_last()(mod)
    assert 'kernel_layout="HWIO"' in new.script() and "permute_dims" in new.script()
    rng = np.random.default_rng(0)
    x = rng.standard_normal([int(d) for d in mod["main"].params[0].ty.shape]).astype("float32")
    w = rng.standard_normal([int(d) for d in mod["main"].params[1].ty.shape]).astype("float32")
    np.testing.assert_allclose(_run(new, x, w), _run(mod, x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c, o, k, groups", [(16, 32, 3, 1), (1, 1, 3, 1), (16, 16, 1, 4), (128, 128, 3, 2)])
def test_other_convolutions_are_left_alone(c, o, k, groups):
    """A dense convolution, a one-channel convolution (dense and depthwise
    at once), and grouped ones ShortReduction does not take (a 1x1; 64
    channels a group, 576 steps): their weights stay as they are."""
    mod = _conv_module(c, o, k, 1, 6, groups=groups)
    assert depthwise_channels_last()(mod).script() == mod.script()


def test_constant_weights_are_permuted_once_at_build_time_and_read_along_the_channel():
    """As in the optimize stage: bound weights, the pass, FoldConstant: no
    permute_dims is left to run, and the legalized kernel reads the weight
    with the channel (the axis neighbouring threads take) innermost."""
    from deploy.tvm_compat import RelaxConstant, relax

    mod = _conv_module(48, 48, 5, 1, 7, groups=48)
    w = np.random.default_rng(1).standard_normal((48, 5, 5, 1)).astype("float32")
    mod = relax.transform.BindParams("main", {"w": w})(mod)
    out = relax.transform.FoldConstant()(depthwise_channels_last()(mod))
    assert "permute_dims" not in out["main"].script()
    (weight,) = [c for c in out["main"].body.blocks[0].bindings[0].value.args if isinstance(c, RelaxConstant)]
    np.testing.assert_array_equal(weight.value.numpy(), w.transpose(1, 2, 0, 3))  # (5, 5, 48, 1)
    prim = relax.transform.LegalizeOps()(out)
    (conv,) = [f for gv, f in prim.functions.items() if gv.name_hint == "conv2d"]
    reads = [ln for ln in conv.script().splitlines() if "T.reads(" in ln and "v_ry" in ln]
    assert reads and all("[v_ry, v_rx, v_ff" in ln for ln in reads), reads
