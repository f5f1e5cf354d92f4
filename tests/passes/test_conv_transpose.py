"""deploy/passes/conv_transpose.py: a transposed convolution whose kernel
equals its stride becomes a 2-D GEMM (its bias among the GEMM's columns)
and a depth to space, computing the same; the others are left alone; in
the optimize stage U-Net keeps no conv2d_transpose and ConvertLayout's
transposes around it cancel."""

from __future__ import annotations

import numpy as np
import pytest

from deploy.passes import conv_transpose
from deploy.passes.conv_transpose import conv_transpose_gemm
from deploy.passes.transposes import cancel_transposes

from .test_flat_gemm import _args, _parse, _run


def _module(n=2, c=6, h=5, w=3, o=4, k=(2, 2), stride=(2, 2), padding=(0, 0, 0, 0), output_padding=(0, 0),
            groups=1, bias=(1, 4, 1, 1), nhwc=False, dtype="float32"):
    """A conv2d_transpose (NCHW/IOHW, as TOPI lowers it) and a bias add; with
    `nhwc`, between the transposes ConvertLayout puts around it."""
    x_shape, into = ((n, h, w, c), "xi = R.permute_dims(x, axes=[0, 3, 1, 2])") if nhwc else ((n, c, h, w), "xi = x")
    out = "z = R.permute_dims(y, axes=[0, 2, 3, 1])" if nhwc else "z = y"
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor({x_shape}, "{dtype}"), wt: R.Tensor(({c}, {o // groups}, {k[0]}, {k[1]}), "{dtype}"),
             b: R.Tensor({bias}, "{dtype}")):
        with R.dataflow():
            {into}
            t = R.nn.conv2d_transpose(xi, wt, strides={list(stride)}, padding={list(padding)},
                                      output_padding={list(output_padding)}, groups={groups})
            y = R.add(t, b)
            {out}
            R.output(z)
        return z
""")


def _same(mod, new):
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [(2, 2), (3, 3), (2, 4), (1, 1)], ids=str)
def test_a_kernel_the_size_of_its_stride_is_a_gemm_and_a_depth_to_space(kernel):
    mod = _module(k=kernel, stride=kernel)
    new = conv_transpose_gemm()(mod)
    script = new.script()
    assert "conv2d_transpose" not in script and "R.matmul" in script
    assert "conv2d_transpose" in mod.script()  # the input module is left as it was
    _same(mod, new)


@pytest.mark.parametrize("bias", [(1, 4, 1, 1), (4, 1, 1)], ids=str)
def test_the_bias_joins_the_gemms_columns(bias):
    """The add reads the 2-D GEMM (its kernel's epilogue), not the 4-D result."""
    mod = _module(o=4, k=(2, 3), stride=(2, 3), bias=bias)
    new = conv_transpose_gemm()(mod)
    adds = [line for line in new.script().split("def main")[1].splitlines() if "R.add(" in line]
    assert len(adds) == 1 and "R.Tensor((30, 24)" in adds[0], adds
    _same(mod, new)


@pytest.mark.parametrize("bias", [(1, 4, 10, 1), (1,), (1, 1, 1, 6)], ids=str)
def test_a_bias_of_another_shape_stays_where_it_was(bias):
    mod = _module(bias=bias)
    new = conv_transpose_gemm()(mod)
    adds = [line for line in new.script().split("def main")[1].splitlines() if "R.add(" in line]
    assert "R.matmul" in new.script() and len(adds) == 1 and "R.Tensor((2, 4, 10, 6)" in adds[0], adds
    _same(mod, new)


def test_between_convertlayouts_transposes_none_is_left():
    """The NHWC path: the input's transpose is not made again, and the
    output's cancels against the next one (passes/transposes.py). (The
    weights' permute is a parameter's here; a constant's is folded.)"""
    mod = _module(nhwc=True, n=1, c=8, h=4, w=4, o=16, bias=(1, 16, 1, 1))
    new = cancel_transposes()(conv_transpose_gemm()(mod))
    permutes = [line for line in new.script().splitlines() if "R.permute_dims(" in line and "(wt," not in line]
    assert len(permutes) == 1 and "axes=[0, 1, 3, 2, 4, 5]" in permutes[0], permutes  # the depth to space alone
    _same(mod, new)


def test_an_input_transposed_in_an_earlier_block_is_transposed_again():
    """ConvertLayout's transpose is only skipped where its input is in
    scope: a dataflow var of an earlier block is not (a reviewer's find)."""
    from deploy.tvm_compat import relax

    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((1, 4, 4, 8), "float32"), wt: R.Tensor((8, 4, 2, 2), "float32")):
        with R.dataflow():
            a = R.add(x, x)
            xi = R.permute_dims(a, axes=[0, 3, 1, 2])
            R.output(xi)
        s = R.nn.relu(xi)
        with R.dataflow():
            t = R.nn.conv2d_transpose(xi, wt, strides=[2, 2])
            R.output(t)
        return (t, s)
""")
    new = conv_transpose_gemm()(mod)
    assert "conv2d_transpose" not in new.script()
    relax.analysis.well_formed(new)  # (raises where a var is used out of its scope)
    _same(mod, new)


@pytest.mark.parametrize("case", [
    dict(k=(4, 4), stride=(2, 2), padding=(1, 1, 1, 1)),  # a DCGAN's: the blocks overlap
    dict(k=(2, 2), stride=(2, 2), padding=(0, 0, 1, 1)),
    dict(k=(2, 2), stride=(2, 2), output_padding=(1, 1)),
    dict(k=(2, 2), stride=(2, 2), groups=2),
    dict(k=(3, 3), stride=(2, 2)),
], ids=["4x4-stride-2", "padded", "output-padding", "groups", "3x3-stride-2"])
def test_others_are_left_as_they_are(case):
    mod = _module(**case)
    assert "conv2d_transpose" in conv_transpose_gemm()(mod).script()


def test_off_leaves_it(monkeypatch):
    monkeypatch.setattr(conv_transpose, "ENABLED", False)
    assert "conv2d_transpose" in conv_transpose_gemm()(_module()).script()


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_unet_keeps_no_transposed_convolution_or_transpose_around_it(tmp_path, precision):
    """The optimize stage on the corpus's U-Net for sm_90: its two
    upsamplings are GEMMs with their bias, each depth to space fused with the
    skip concatenation that reads it; no other kernel transposes but the
    layout changes of the model's input and output (NCHW <-> NHWC)."""
    from deploy import config, export, frontend, optimize, targets
    from deploy.tvm_compat import tirx

    cfg = config.from_dict({"model": {"source": "unet", "size": "small"},
                            "cuda": {"buckets": [1], "tune_buckets": [1], "trials": 0, "precision": precision}})
    fe = frontend.run(cfg.cuda, export.run(cfg, tmp_path / "export"), tmp_path / "frontend")
    mod, _ = optimize.optimize_module(fe.load_module(1), cfg.cuda, targets.resolve("cuda:sm_90").tvm_target())
    names = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)]
    assert not [n for n in names if "conv2d_transpose" in n], names
    assert len([n for n in names if n.startswith("fused_matmul") and "_add" in n]) >= 2, names
    moves = [n for n in names if "transpose" in n]
    assert len([n for n in moves if "concatenate" in n]) == 2 and len(moves) == 4, moves  # + the input's and output's
