"""deploy/passes/implicit_gemm.py (applied by flat_gemm.py): KxK NHWC
convolutions as implicit GEMMs. The rewrite computes the same, fuses into one
2-D GEMM kernel with its epilogue, is applied only where meant, and that
kernel is one our mma.sync schedule takes, its im2col tiles copied by
predicated cp.async (built for sm_90 here; on the GPU, `-m gpu`, run)."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import config, targets
from deploy.errors import ConfigError
from deploy.optimize import phases
from deploy.passes import implicit_gemm, mma_gemm
from deploy.passes.flat_gemm import flat_epilogues, flat_gemm
from deploy.tuning import builder as tune_builder
from deploy.tvm_compat import tvm

from ..conftest import load_script
from .test_flat_gemm import _args, _bottleneck, _fused, _kernels, _parse, _run


@pytest.mark.parametrize("stride", [1, 2])
def test_the_rewrite_computes_the_same_in_one_gemm_kernel_with_its_epilogue(stride):
    """A 3x3 convolution (fp32 sum) with its cast, bias, residual add and
    ReLU becomes an implicit GEMM carrying its whole epilogue in 2-D; the
    second 3x3 convolution, summed in fp16, is left as it is."""
    mod = _bottleneck(k=3, c=64, o=32, stride=stride)
    new = flat_epilogues(convs=True)(mod)
    assert new.script().count("R.nn.conv2d(") == 1 and mod.script().count("R.nn.conv2d(") == 2  # (input unchanged)
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()
    kernels = _kernels(_fused(new))
    fused = [n for n in kernels if n.startswith("fused_conv2d_gemm")]
    assert len(fused) == 1 and all(op in fused[0] for op in ("cast", "add", "add1", "relu")), kernels.keys()
    assert all(n.startswith(("fused_conv2d_gemm", "conv2d", "reshape")) for n in kernels), kernels.keys()
    assert "if_then_else" in kernels[fused[0]].script()  # the padding, in the im2col producer


def test_flat_gemm_takes_the_1x1_convolutions_and_this_pass_the_kxk_ones():
    mod = _bottleneck(k=1, c=64, o=32)
    text = flat_gemm(convs=True)(mod).script()
    assert "R.matmul" in text and "R.nn.conv2d(" in text  # (the 3x3 one sums in fp16: left alone)
    text = flat_gemm(convs=True)(_conv((2, 8, 8, 64), (32, 3, 3, 64))).script()
    assert "conv2d_gemm" in text and "R.nn.conv2d(" not in text


def _conv(x, w, dtype="float16", groups=1, padding=1, dilation=1, out_dtype="float32", out_layout="NHWC"):
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor({x}, "{dtype}"), w: R.Tensor({w}, "{dtype}")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[{padding}] * 4, groups={groups}, dilation=[{dilation}, {dilation}],
                            data_layout="NHWC", kernel_layout="OHWI", out_layout="{out_layout}",
                            out_dtype="{out_dtype}")
            R.output(y)
        return y
""")


@pytest.mark.parametrize("why, x, w, kwargs", [
    ("a 1x1 kernel (flat_gemm's)", (2, 8, 8, 64), (32, 1, 1, 64), {"padding": 0}),
    ("3 input channels (a stem: no 16-byte copies)", (2, 8, 8, 3), (32, 3, 3, 3), {}),
    ("output channels 16 does not divide", (2, 8, 8, 64), (24, 3, 3, 64), {}),
    ("two groups of 32 channels", (2, 8, 8, 64), (32, 3, 3, 32), {"groups": 2}),
    ("dilation", (2, 8, 8, 64), (32, 3, 3, 64), {"dilation": 2, "padding": 2}),
    ("fp32", (2, 8, 8, 64), (32, 3, 3, 64), {"dtype": "float32"}),
    ("an fp16 sum (accumulate = fp16: no GEMM our schedule takes)", (2, 8, 8, 64), (32, 3, 3, 64),
     {"out_dtype": "float16"}),
    ("an NCHW output", (2, 8, 8, 64), (32, 3, 3, 64), {"out_layout": "NCHW"}),
])
def test_other_convolutions_are_left_alone(why, x, w, kwargs):
    new = flat_epilogues(convs=True)(_conv(x, w, **kwargs))
    assert "R.nn.conv2d" in new.script(), why


def _strided_1x1(dtype="float16", out_dtype="float32"):
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 8, 8, 64), "{dtype}"), w: R.Tensor((32, 1, 1, 64), "{dtype}")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=[2, 2], data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC",
                            out_dtype="{out_dtype}")
            R.output(y)
        return y
""")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_strided_1x1_convolution_and_an_fp32_one_in_tf32_become_implicit_gemms(dtype):
    """ResNet's downsampling (1x1, stride 2) computes the same as an
    implicit GEMM where flat_gemm makes the other 1x1 convolutions GEMMs
    (not with `flat_epilogues`: the residual add would join a 4-D and a
    2-D branch); an fp32 convolution is taken only in tf32."""
    mod = _strided_1x1(dtype, "float32")
    tf32 = dtype == "float32"
    new = flat_gemm(convs=True, tf32=tf32)(mod)
    assert "conv2d_gemm" in new.script() and "R.nn.conv2d(" not in new.script()
    assert "R.nn.conv2d(" in flat_epilogues(convs=True, tf32=tf32)(mod).script()
    if tf32:
        assert "R.nn.conv2d(" in flat_gemm(convs=True)(mod).script()  # (strict fp32: left alone)
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


def test_the_flag_reaches_the_profile(monkeypatch):
    from deploy import cli

    monkeypatch.setattr(targets, "resolve", lambda text: targets.TargetInfo(
        "cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H200", False))
    for flag, want in (("--implicit-gemm", True), ("--no-implicit-gemm", False)):
        cfg = cli.prepare(cli.parser().parse_args(["run", "-m", "tiny_cnn", flag]))[0]
        assert cfg.cuda.implicit_gemm is want


def test_the_phase_and_the_config():
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"implicit_gemm": True}})
    assert [name for name, _ in phases(cfg.cuda)][-2:] == ["implicit_gemm", "fusion"]
    assert "implicit_gemm" not in [n for n, _ in phases(config.from_dict({"model": {"source": "tiny_cnn"}}).cuda)]
    both = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"implicit_gemm": True, "flat_gemm": True}})
    assert [name for name, _ in phases(both.cuda)][-2:] == ["flat_gemm", "fusion"]
    for layout in ("NCHWc", "NCHW"):
        table = {"implicit_gemm": True} if layout == "NCHWc" else {"implicit_gemm": True, "layout": layout}
        with pytest.raises(ConfigError, match="implicit_gemm"):
            config.from_dict({"model": {"source": "tiny_cnn"}, ("llvm" if layout == "NCHWc" else "cuda"): table})


def _resnet_like_kernel(n=2, hw=8):
    """ResNet's 3x3 convolution + bias + ReLU in a size the tests build
    quickly: by default 2 x 8 x 8 rows (128), K = 9 x 64, 64 output channels."""
    mod = _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(({n}, {hw}, {hw}, 64), "float16"), w: R.Tensor((64, 3, 3, 64), "float16"),
             b: R.Tensor((1, 1, 1, 64), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                            out_layout="NHWC", out_dtype="float32")
            z = R.nn.relu(R.add(R.astype(y, "float16"), b))
            R.output(z)
        return z
""")
    kernels = _kernels(_fused(flat_epilogues(convs=True)(mod)))
    (name,) = [n for n in kernels if n.startswith("fused_conv2d_gemm")]
    return kernels[name].with_attr("global_symbol", "main")


def test_our_mma_schedule_takes_it_and_copies_the_im2col_tiles_by_predicated_cp_async(sm90):
    func = _resnet_like_kernel()
    gemm = mma_gemm.match(func)
    assert gemm is not None and (gemm.m, gemm.n, gemm.k, gemm.b_transposed) == (128, 64, 576, True)
    assert gemm.producers == ["im2col"]
    spaces = mma_gemm.spaces(func, sm90)
    assert spaces
    src = tune_builder.lean_build(spaces[0].mod, sm90, None).imports[0].inspect_source()
    # the padding is a predicate of the copy (zero-filled), not a branch around a plain load
    assert "cp_async_legacy_pred" in src and "mma.sync" in src and "ldmatrix" in src


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True], ids=["128-rows", "3136-rows-padded"])
def test_each_configuration_computes_the_convolution(sm90, padded):
    """On the GPU: each configuration against the unscheduled kernel lowered
    for the CPU; also with ResNet-50's 7x7 stage's 3,136 rows padded to
    3,200 by pad_gemm (the rows past the end must not be written)."""
    from deploy.passes.pad_gemm import pad_prim_func
    from deploy.tvm_compat import ms

    func = _resnet_like_kernel(64, 7) if padded else _resnet_like_kernel()
    scheduled = pad_prim_func(func) if padded else func
    assert (scheduled is not None) and (mma_gemm.match(scheduled).m == (3200 if padded else 128))
    info = ms.arg_info.ArgInfo.from_prim_func(func)
    rng = np.random.default_rng(3)
    args = [(rng.standard_normal([int(d) for d in a.shape]) / 4).astype(str(a.dtype)) for a in info]
    cpu = tvm.tirx.build(tvm.IRModule({"main": func}), target="llvm")
    want = [tvm.runtime.tensor(a) for a in args]
    cpu["main"](*want)
    dev = tvm.cuda(0)
    for sch in mma_gemm.spaces(scheduled, sm90):
        lib = tune_builder.lean_build(sch.mod, sm90, None)
        got = [tvm.runtime.tensor(a, dev) for a in args]
        lib["main"](*got)
        np.testing.assert_allclose(got[-1].numpy().astype("float32"), want[-1].numpy().astype("float32"),
                                   rtol=2e-2, atol=2e-2, err_msg=mma_gemm.config_of(sch.mod))


def test_the_probe_refuses_bad_arguments_in_one_line_and_writes_nothing(tmp_path, capsys):
    probe = load_script("implicit_gemm_probe")
    out = tmp_path / "out"
    for args, why in (
        (["--convs", "64x14x14x256-256-3"], "expected NxHxWxC-O-K-sS"),
        (["--convs", "64x1x1x8-16-4-s1"], "larger than the padded input"),
        (["--configs", "128x128x32-w2x2-s9"], "unknown configuration"),
        (["--convs", "2x8x8x64-64-3-s1", "--target", "bogus"], "--target bogus"),
    ):
        assert probe.main([*args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    (tmp_path / "file").write_text("")
    assert probe.main(["--out", str(tmp_path / "file")]) == 2
    assert "not a folder" in capsys.readouterr().err
    (c,) = probe.parse_convs("64x56x56x128-128-3-s2")
    assert (c["out_height"], c["padding"], c["gflop"]) == (28, 1, pytest.approx(2 * 64 * 28 * 28 * 128 * 9 * 128 / 1e9))


def test_the_te_is_the_convolution():
    """conv_as_gemm alone, on llvm, against NumPy: a 3x5 kernel, strides
    (2, 1), padding [top 0, left 1, bottom 2, right 1]."""
    from tvm import te

    n, h, w, c, o, r, s = 1, 6, 5, 8, 16, 3, 5
    top, left, bottom, right = 0, 1, 2, 1
    x = te.placeholder((n, h, w, c), "float32", name="x")
    w2 = te.placeholder((o, r * s * c), "float32", name="w")
    out_shape = (n, (h + top + bottom - r) // 2 + 1, (w + left + right - s) // 1 + 1, o)
    gemm = implicit_gemm.conv_as_gemm(x, w2, (r, s), (2, 1), (top, left, bottom, right), out_shape, "float32")
    lib = tvm.tirx.build(tvm.IRModule({"main": te.create_prim_func([x, w2, gemm])}), target="llvm")
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((n, h, w, c)).astype("float32")
    wn = rng.standard_normal((o, r, s, c)).astype("float32")
    got = tvm.runtime.tensor(np.zeros((int(gemm.shape[0]), o), "float32"))
    lib["main"](tvm.runtime.tensor(xn), tvm.runtime.tensor(wn.reshape(o, -1)), got)
    xp = np.pad(xn, ((0, 0), (top, bottom), (left, right), (0, 0)))
    want = np.zeros(out_shape, "float32")
    for i in range(out_shape[1]):
        for j in range(out_shape[2]):
            patch = xp[:, i * 2:i * 2 + r, j:j + s, :]
            want[:, i, j, :] = np.einsum("nrsc,orsc->no", patch, wn)
    np.testing.assert_allclose(got.numpy(), want.reshape(-1, o), rtol=1e-5, atol=1e-5)


def test_rows_128_does_not_divide_are_padded_so_that_128_row_tiles_take_them(sm90):
    """passes/pad_gemm.py on an implicit GEMM: ResNet-50's 7x7 stage at
    batch 64 (3,136 rows, a multiple of 64 but not of 128; channels cut to
    64 here) is padded to 3,200 rows, its im2col inlined into the padded
    copy: our schedule takes it with 128-row tiles, still predicated copies."""
    from deploy.passes.pad_gemm import pad_prim_func

    mod = _conv((64, 7, 7, 64), (64, 3, 3, 64))
    kernels = _kernels(_fused(flat_epilogues(convs=True)(mod)))
    (name,) = [n for n in kernels if "conv2d_gemm" in n]
    func = kernels[name].with_attr("global_symbol", "main")
    assert mma_gemm.match(func).m == 3136
    padded = pad_prim_func(func)
    gemm = mma_gemm.match(padded)
    assert gemm is not None and gemm.m == 3200 and len(gemm.producers) == 1
    assert "128x64x32-w2x2-s4" in mma_gemm.configs_for(gemm)  # (before: none of 128 rows)
    sch = mma_gemm.schedule(padded, gemm, "128x64x32-w2x2-s4")
    src = tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()
    assert "cp_async_legacy_pred" in src
    # the same rows in a plain GEMM (a 1x1 convolution under flat_gemm) are left as they are:
    # 64 divides them, pad_gemm's rule for every other kernel
    plain = _kernels(_fused(flat_gemm()(_conv((64, 7, 7, 64), (64, 1, 1, 64), padding=0))))
    (gemm_name,) = [n for n in plain if n.startswith("matmul") or n.startswith("fused_matmul")]
    assert mma_gemm.match(plain[gemm_name]).m == 3136 and pad_prim_func(plain[gemm_name]) is None
    # an implicit GEMM's columns keep pad_gemm's rule for every kernel: 1,088 (64 divides it) stay
    wide = _kernels(_fused(flat_epilogues(convs=True)(_conv((2, 16, 32, 64), (1088, 3, 3, 64)))))
    (wide_name,) = [n for n in wide if "conv2d_gemm" in n]
    assert mma_gemm.match(wide[wide_name]).m == 1024 and pad_prim_func(wide[wide_name]) is None


def test_the_probe_builds_a_convolution_here_and_says_what_it_could_not(tmp_path):
    """Without a GPU the probe builds (nvcc's registers where nvcc is there)
    and records, per convolution, why none was built."""
    import json

    probe = load_script("implicit_gemm_probe")
    rc = probe.main(["--convs", "2x8x8x64-64-3-s1,2x8x8x3-64-3-s1", "--configs", "128x64x32-w2x2-s4",
                     "--target", "cuda:sm_90", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "probe.json").read_text())["rows"]
    built, stem = rows
    assert built["config"] == "128x64x32-w2x2-s4" and built["predicated"] and "error" not in built
    assert stem["config"] == "none" and "input channels a multiple of 8" in stem["error"]
    assert "| 2x8x8x64-64-3-s1 | 128x64x32-w2x2-s4 |" in (tmp_path / "probe.md").read_text()


@pytest.mark.parametrize("cuda, arch, direct, want", [
    ({}, "sm_90", False, True),  # the default: the wgmma kernel in use
    ({}, "sm_90", True, False),  # (a database tuned on direct convolutions: tuning/graph.py)
    ({}, "sm_80", False, False),  # no wgmma kernel there
    ({"wgmma_gemm": False}, "sm_90", False, False),
    ({"precision": "fp32"}, "sm_90", False, False),
    ({"accumulate": "fp16"}, "sm_90", False, False),  # (an fp16 sum: no GEMM the kernel takes)
    ({"implicit_gemm": False}, "sm_90", False, False),  # asked: as asked
    ({"implicit_gemm": True}, "sm_80", True, True),
])
def test_by_default_convolutions_become_gemms_on_sm90(cuda, arch, direct, want):
    """By default the optimize stage makes a bucket's convolutions GEMMs
    (KxK ones implicit GEMMs, 1x1 ones 2-D GEMMs) on sm_90 where the wgmma
    kernel is in use, unless the bucket's database was tuned on direct
    convolutions; elsewhere, or where the profile says, as it says."""
    from deploy import optimize

    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": cuda})
    target = targets.resolve(f"cuda:{arch}").tvm_target()
    assert cfg.cuda.implicit_gemms(arch == "sm_90", direct) is want
    assert ("implicit_gemm" in [n for n, _ in phases(cfg.cuda, target, direct)]) is want
    if cuda:
        return
    mod, _ = optimize.optimize_module(_bottleneck(n=4, k=3, o=32), cfg.cuda, target, tuned_direct=direct)
    assert any(n.startswith("fused_conv2d_gemm") for n in _kernels(mod)) is want, _kernels(mod).keys()


@pytest.mark.parametrize("stride", [1, 2])
def test_the_default_makes_1x1_convolutions_gemms_and_leaves_matmuls(stride):
    """`flat_epilogues(convs=True, conv1x1=True)` (the default's phase):
    a 1x1 convolution becomes a 2-D GEMM (strided, an implicit GEMM), as
    flat_gemm makes it; a transformer's N-D dense layer stays as it was
    (flat_gemm would make it 2-D)."""
    from .test_flat_gemm import _dense

    text = flat_epilogues(convs=True, conv1x1=True)(_bottleneck(k=1, c=64, o=32, stride=stride)).script()
    assert ("R.matmul" in text) is (stride == 1) and ("conv2d_gemm" in text) is (stride == 2)
    assert text.count("R.nn.conv2d(") == 1  # (the 3x3 one summed in fp16: left alone)
    assert flat_epilogues(convs=True, conv1x1=True)(_dense()).script() == flat_epilogues()(_dense()).script()
    assert flat_gemm()(_dense()).script() != flat_epilogues()(_dense()).script()


def test_the_default_leaves_squeeze_excitations_convolutions_of_a_1x1_map():
    """Squeeze-excitation's two 1x1 convolutions of a 1x1 map (a row an
    image), then the sigmoid gating the feature map: under the default's
    phase they stay convolutions, the second fused with its sigmoid and the
    multiply that broadcasts it over the map (one kernel, as the rule
    broadcast-epilogue takes it); flat_gemm() still makes them GEMMs."""
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4, 6, 6, 16), "float16"), w1: R.Tensor((8, 1, 1, 16), "float16"),
             w2: R.Tensor((16, 1, 1, 8), "float16")):
        with R.dataflow():
            s = R.mean(x, axis=[1, 2], keepdims=True)
            e = R.nn.conv2d(s, w1, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC", out_dtype="float16")
            r = R.nn.relu(e)
            f = R.nn.conv2d(r, w2, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC", out_dtype="float16")
            g = R.sigmoid(f)
            z = R.multiply(x, g)
            R.output(z)
        return z
""")
    new = flat_epilogues(convs=True, conv1x1=True)(mod)
    assert "R.matmul" not in new.script() and new.script().count("R.nn.conv2d(") == 2
    assert any("conv2d" in name and "multiply" in name for name in _kernels(_fused(new)))
    assert flat_gemm()(mod).script().count("R.matmul") == 2
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=1e-3, atol=1e-3)


def _stem(n=2, hw=16, c=3, o=64, k=7, stride=2):
    """An RGB stem: a k x k convolution of `c` channels, stride 2, padding
    k // 2, with its bias and ReLU (fp16 data, fp32 sum)."""
    p = k // 2
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(({n}, {hw}, {hw}, {c}), "float16"), w: R.Tensor(({o}, {k}, {k}, {c}), "float16"),
             b: R.Tensor((1, 1, 1, {o}), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=[{stride}, {stride}], padding=[{p}, {p}, {p}, {p}], data_layout="NHWC",
                            kernel_layout="OHWI", out_layout="NHWC", out_dtype="float32")
            z = R.nn.relu(R.add(R.astype(y, "float16"), b))
            R.output(z)
        return z
""")


@pytest.mark.parametrize("c,k,stride,hw,blocks,want_k", [
    (3, 7, 2, 16, False, 7 * 7 * 8), (4, 3, 2, 16, False, 3 * 3 * 8), (1, 3, 1, 16, True, 3 * 3 * 8),
    (3, 7, 2, 16, True, 4 * 4 * 16), (4, 3, 2, 16, True, 2 * 2 * 16), (1, 3, 2, 16, True, 2 * 2 * 8),
    (3, 4, 2, 15, True, 2 * 2 * 16), (3, 7, 2, 31, True, 4 * 4 * 16)],
    ids=["rgb-7x7", "rgba-3x3", "grey-stride1", "rgb-7x7-blocked", "rgba-3x3-blocked", "grey-3x3-blocked",
         "rgb-4x4-odd-blocked", "rgb-7x7-odd-blocked"])
def test_a_stems_few_channels_are_padded_to_8_where_the_wgmma_kernel_takes_it(c, k, stride, hw, blocks, want_k,
                                                                                monkeypatch):
    """With the wgmma kernel in use (`wgmma`), a convolution of fewer than 8
    channels (RGB, RGBA, grey) becomes an implicit GEMM of its data and
    weights padded with zero channels to 8 (K = k x k x 8) or, at stride 2
    (SPACE_TO_DEPTH), of 2 x 2 blocks of pixels as channels, a stride-1
    kernel of ceil(k/2) (K = ceil(k/2)^2 x 4 x the channels made even): the
    same result, a gather the kernel plans, the data's padding (and
    blocking) a kernel of its own here (in a model, fused with its producer:
    the input's transpose). Without the kernel, or with FEW_CHANNELS 0, it
    stays a convolution."""
    from deploy.passes import wgmma_gemm

    monkeypatch.setattr(implicit_gemm, "SPACE_TO_DEPTH", blocks)
    mod = _stem(c=c, k=k, stride=stride, hw=hw)
    new = flat_epilogues(convs=True, wgmma=True, conv1x1=True)(mod)
    assert "conv2d_gemm" in new.script() and new.script().count("R.nn.pad(") == 2
    assert ("R.permute_dims(" in new.script()) == (blocks and stride == 2)
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=2e-3, atol=2e-3)
    kernels = _kernels(_fused(new))
    (gemm,) = [f for name, f in kernels.items() if "conv2d_gemm" in name]
    p = wgmma_gemm.plan(gemm, gather=True)
    assert p is not None and p.gather is not None and p.k == want_k
    assert "conv2d_gemm" not in flat_epilogues(convs=True, conv1x1=True)(mod).script()


@pytest.mark.parametrize("c,kernel,pads,hw,blocked", [
    (3, (7, 5), (3, 2, 2, 1), (19, 17), True),  # (R != S, padding uneven)
    (1, (3, 5), (0, 2, 4, 1), (15, 16), True),
    (3, (3, 3), (5, 4, 6, 7), (14, 14), True),  # (more padding than the blocked kernel reads)
    (6, (3, 3), (1, 1, 1, 1), (16, 16), False),  # (K 2 x 2 x 24 > 3 x 3 x 8: padded to 8 instead)
    (3, (2, 2), (0, 0, 0, 0), (17, 17), False),  # (the blocked data would have to be cropped)
], ids=["7x5-uneven", "grey-3x5", "padded-past", "6-channels", "even-kernel-odd-size"])
def test_a_blocked_stem_computes_the_convolution_of_any_kernel_and_padding(c, kernel, pads, hw, blocked):
    """Stride-2 stems of other kernels and paddings (the review's cases):
    blocked where that has fewer products and reads no more than the padded
    data, else padded to 8 channels; the same result either way."""
    (kh, kw), (h, w) = kernel, hw
    mod = _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, {h}, {w}, {c}), "float16"), w: R.Tensor((32, {kh}, {kw}, {c}), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=[2, 2], padding={list(pads)}, data_layout="NHWC",
                            kernel_layout="OHWI", out_layout="NHWC", out_dtype="float32")
            R.output(y)
        return y
""")
    rows = 2 * ((h + pads[0] + pads[2] - kh) // 2 + 1) * ((w + pads[1] + pads[3] - kw) // 2 + 1)
    assert rows % 16 == 0  # (the cases are chosen so that the wgmma kernel takes the rows)
    new = flat_epilogues(convs=True, wgmma=True, conv1x1=True)(mod)
    assert "conv2d_gemm" in new.script() and ("R.permute_dims(" in new.script()) == blocked
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=2e-3, atol=2e-3)


def test_few_channels_off_leaves_the_stem_alone(monkeypatch):
    monkeypatch.setattr(implicit_gemm, "FEW_CHANNELS", 0)
    assert "conv2d_gemm" not in flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem()).script()


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [False, True], ids=["padded", "blocked"])
def test_gpu_a_padded_stems_gemm_computes_the_convolution(blocks, monkeypatch):
    """The 7x7 stem of 3 channels padded to 8 (or blocked in 2 x 2 pixels:
    SPACE_TO_DEPTH), on the wgmma kernel (two persistent CTAs), against its
    function lowered for the CPU."""
    from deploy.passes import wgmma_gemm

    from .test_wgmma_gemm import _gpu_error

    monkeypatch.setattr(wgmma_gemm, "SMS", 2)
    monkeypatch.setattr(implicit_gemm, "SPACE_TO_DEPTH", blocks)
    kernels = _kernels(_fused(flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem(n=4, hw=32))))
    (gemm,) = [f.with_attr("global_symbol", "main") for name, f in kernels.items() if "conv2d_gemm" in name]
    assert _gpu_error(gemm, wgmma_gemm.replacement(gemm, gather=True)) < 2e-3


def test_a_stem_the_kernel_would_not_take_is_not_padded(monkeypatch):
    """At 440 images of 224 x 224 the padded stem's A (802,816 x 440 / 64
    rows x 392) passes int32: the wgmma kernel would decline it and DLight
    would get 2.7 times the products, so it stays a convolution."""
    from deploy.passes import wgmma_gemm

    assert not wgmma_gemm.takes(440 * 112 * 112, 64, 7 * 7 * 8) and wgmma_gemm.takes(64 * 112 * 112, 64, 7 * 7 * 8)
    monkeypatch.setattr(implicit_gemm, "SPACE_TO_DEPTH", False)
    assert "conv2d_gemm" not in flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem(n=440, hw=224)).script()
    assert "conv2d_gemm" in flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem(n=64, hw=224)).script()
    # blocked in 2 x 2 pixels (K = 4 x 4 x 16), 440 images index in int32, 700 do not
    monkeypatch.setattr(implicit_gemm, "SPACE_TO_DEPTH", True)
    assert "conv2d_gemm" in flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem(n=440, hw=224)).script()
    assert "conv2d_gemm" not in flat_epilogues(convs=True, wgmma=True, conv1x1=True)(_stem(n=700, hw=224)).script()
