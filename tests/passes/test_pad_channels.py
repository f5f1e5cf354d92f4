"""deploy/passes/pad_channels.py: channel counts no block of 16 divides are
padded so that the CPU's blocked layout takes blocks of 16; the model
computes the same, and its outputs keep their shapes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploy import config, optimize
from deploy.passes import nchwc, pad_channels
from deploy.tvm_compat import relax, tvm


@pytest.mark.parametrize("channels, want", [(58, 64), (116, 128), (232, 240), (1000, 1008), (40, 48), (72, 80), (29, 32),
                                            (24, None), (20, None), (8, None), (3, None), (64, None), (1024, None)])
def test_padded(channels, want):
    """Up to the next 16 where that adds at most a quarter of the channels."""
    assert pad_channels.padded(channels) == want


def _unit(trap: bool = True):
    """A ShuffleNetV2 unit's branch on 58 channels (1x1 conv + bias + relu,
    depthwise 3x3 + bias, 1x1 conv + bias + relu), a squeeze-excitation
    (spatial mean, 1x1 convs, sigmoid, a product), a channel-wise scale and a
    divisor, a max pool, a concatenation with the input, and a 1x1
    classifier of 40 channels whose spatial mean is the output. With
    `trap`, a constant, and then the branch itself, divided by a maximum of
    the branch and 0.5 (whose padding would hold zeros) feed convolutions: a
    padded quotient would put 0/0 into them."""
    bb = relax.BlockBuilder()
    rng = np.random.default_rng(0)

    def const(*shape, low=None):
        data = rng.standard_normal(shape).astype("float32") * 0.2
        return relax.const(np.abs(data) + low if low is not None else data)

    op = relax.op
    x = relax.Var("x", relax.TensorType((1, 58, 10, 10), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.relu(op.add(op.nn.conv2d(x, const(58, 58, 1, 1)), const(1, 58, 1, 1))))
            y = bb.emit(op.add(op.nn.conv2d(y, const(58, 1, 3, 3), padding=1, groups=58), const(58, 1, 1)))
            y = bb.emit(op.nn.relu(op.add(op.nn.conv2d(y, const(58, 58, 1, 1)), const(1, 58, 1, 1))))
            s = bb.emit(op.mean(y, axis=[2, 3], keepdims=True))
            s = bb.emit(op.sigmoid(op.nn.conv2d(op.nn.relu(op.nn.conv2d(s, const(29, 58, 1, 1))), const(58, 29, 1, 1))))
            y = bb.emit(op.divide(op.multiply(op.multiply(y, s), const(1, 58, 1, 1)), const(58, 1, 1, low=0.5)))
            if trap:
                d = bb.emit(op.maximum(y, const(1, 58, 1, 1, low=0.5)))  # (at least 0.5; its padding 0)
                y = bb.emit(op.add(y, op.nn.conv2d(op.divide(const(1, 58, 1, 1, low=1.0), d), const(58, 58, 1, 1))))
                y = bb.emit(op.add(y, op.nn.conv2d(op.divide(y, d), const(58, 58, 1, 1))))  # (both padded)
            y = bb.emit(op.nn.max_pool2d(y, pool_size=3, padding=1))
            y = bb.emit(op.concat([x, y], axis=1))
            y = bb.emit(op.nn.relu(op.nn.conv2d(y, const(40, 116, 1, 1))))
            out = bb.emit_output(op.mean(y, axis=[2, 3]))
        bb.emit_func_output(out)
    return bb.get()


def _layouts(mod) -> list[tuple[int, str, str]]:
    """(groups, data layout, kernel layout) of each conv2d, in order."""
    found = re.findall(r"R\.nn\.conv2d\(.*groups=(\d+), data_layout=\"(\w+)\", kernel_layout=\"(\w+)\"", mod.script())
    return [(int(g), d, k) for g, d, k in found]


def test_the_padded_channels_take_blocks_of_16():
    """Without the pass the 58-channel convolutions stay in NCHW (no block
    divides 58) and the classifier's 40 channels get blocks of 8; with it
    every convolution is blocked by 16, the squeeze-excitation's 29 channels too."""
    before = nchwc.convert()(_unit())
    assert ("NCHW", "OIHW") in [(d, k) for _, d, k in _layouts(before)]
    after = nchwc.convert()(pad_channels.pad_channels()(_unit()))
    convs = _layouts(after)
    assert len(convs) == 8 and all(d == "NCHW16c" and k.endswith("16o") for _, d, k in convs), convs
    assert [g for g, _, _ in _layouts(after)].count(64) == 1  # the depthwise convolution: 64 groups
    assert "R.nn.pad" in after.script()  # the input's 58 channels padded with zeros


def _profile():
    return config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"layout": "NCHWc"}}).llvm


@pytest.mark.parametrize("enabled", [True, False])
def test_the_padded_model_computes_the_same(llvm_target, monkeypatch, enabled):
    """The optimize stage's whole CPU chain, with and without the pass, against
    the model itself (TVM's plain legalization): the same output, its shape unchanged."""
    from deploy.tvm_compat import VirtualMachine, tensor

    monkeypatch.setattr(pad_channels, "ENABLED", enabled)
    x = np.random.default_rng(1).standard_normal((1, 58, 10, 10)).astype("float32")

    def run(mod):
        ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
        return VirtualMachine(ex, tvm.cpu())["main"](tensor(x)).numpy()

    mod, _ = optimize.optimize_module(_unit(), _profile(), llvm_target.tvm_target())
    got, want = run(mod), run(_unit())
    assert got.shape == want.shape == (1, 40) and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_divisor_that_may_hold_zeros_is_sliced_first():
    """`constant / d` or `y / d` with d padded would divide by the padding:
    each division takes d's sliced twin (and y's), its result 58 channels."""
    text = pad_channels.pad_channels()(_unit()).script()
    lines = [ln for ln in text.splitlines() if "R.divide(" in ln and "metadata" not in ln.split("R.divide(")[1]
             .split(",")[1]]
    assert len(lines) == 2, lines
    for line in lines:
        divisor = re.search(r"R\.divide\([^,]+, (\w+)\)", line).group(1)
        (source,) = [ln for ln in text.splitlines() if ln.strip().startswith(divisor + ":")]
        assert "(1, 58, 10, 10)" in line and "R.strided_slice" in source, (line, source)


def test_disabled_or_without_constant_weights_nothing_changes(monkeypatch):
    """ENABLED off, or weights that are parameters rather than constants:
    the module is left as it is."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 58, 6, 6), "float32"))
    w = relax.Var("w", relax.TensorType((58, 58, 1, 1), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d(x, w)))
        bb.emit_func_output(out)
    params = bb.get()
    assert pad_channels.pad_channels()(params).script() == params.script()
    monkeypatch.setattr(pad_channels, "ENABLED", False)
    assert pad_channels.pad_channels()(_unit()).script() == _unit().script()


def test_where_the_layout_fails_the_padding_is_undone(caplog):
    """ConvNeXt's head (a spatial mean, then LayerNorm over the channels)
    makes TVM's ConvertLayout fail: the model keeps NCHW as it was, without
    the padding of its 58-channel convolution, which only the blocked
    layout repays."""
    import logging

    from .test_nchwc import _mean_then_layer_norm

    plain = _mean_then_layer_norm((58, 64))
    assert "R.strided_slice" in pad_channels.pad_channels()(plain).script()  # (alone, the pass pads the 58)
    assert "R.strided_slice" not in plain.script()
    with caplog.at_level(logging.WARNING, logger="deploy.passes.nchwc"):
        mod = nchwc.convert([pad_channels.pad_channels()])(plain)
    assert "stay in NCHW" in caplog.text
    assert mod.script() == plain.script()
