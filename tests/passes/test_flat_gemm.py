"""deploy/passes/flat_gemm.py: 1x1 convolutions and batched-row matmuls as
2-D GEMMs with their epilogues. The rewrite computes the same, fuses into one
GEMM kernel with its epilogue, is applied only where meant, and gives TVM's
mma.sync rule design spaces the 4-D convolution does not get."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import config
from deploy.errors import ConfigError
from deploy.optimize import phases
from deploy.passes.flat_gemm import flat_gemm
from deploy.tvm_compat import PassContext, VirtualMachine, relax, tensor, tirx, tvm


def _parse(src: str):
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script.parser import parse

    return parse(src, extra_vars={"I": I, "R": R})


def _bottleneck(n=2, h=7, w=5, c=64, o=32, k=1, stride=1):
    """A 1x1 convolution (fp16 in, fp32 sum as after ToMixedPrecision), its
    cast, bias, residual add and ReLU, then a 3x3 convolution of the result;
    both results are outputs."""
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(({n}, {h}, {w}, {c}), "float16"), wt: R.Tensor(({o}, {k}, {k}, {c}), "float16"),
             b: R.Tensor((1, 1, 1, {o}), "float16"), r: R.Tensor(({n}, {ho}, {wo}, {o}), "float16"),
             w2: R.Tensor((16, 3, 3, {o}), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, wt, strides=[{stride}, {stride}], padding=[{k // 2}] * 4, data_layout="NHWC",
                            kernel_layout="OHWI", out_layout="NHWC", out_dtype="float32")
            y1 = R.astype(y, "float16")
            y2 = R.add(y1, b)
            y3 = R.add(r, y2)
            y4 = R.nn.relu(y3)
            z = R.nn.conv2d(y4, w2, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                            out_layout="NHWC", out_dtype="float16")
            R.output(z, y4)
        return (z, y4)
""")


def _dense():
    """A transformer's dense layer: [batch, seq, K] @ [K, N] + bias, GELU."""
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 5, 64), "float16"), w: R.Tensor((64, 48), "float16"), b: R.Tensor((48,), "float16")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float16")
            z = R.nn.gelu(R.add(y, b))
            R.output(z)
        return z
""")


def _run(mod, args):
    ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    out = VirtualMachine(ex, tvm.cpu())["main"](*[tensor(a) for a in args])
    return [o.numpy().astype("float32") for o in ([out] if hasattr(out, "numpy") else list(out))]


def _fused(mod):
    with PassContext(opt_level=3):
        return tvm.ir.transform.Sequential([
            relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
            relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()])(mod)


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}


def _args(mod, seed=0):
    rng = np.random.default_rng(seed)
    params = mod["main"].params
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype)) for p in params]


@pytest.mark.parametrize("make", [_bottleneck, _dense], ids=["conv1x1-bottleneck", "dense-gelu"])
def test_the_rewrite_computes_the_same_in_one_gemm_kernel(make):
    mod = make()
    new = flat_gemm()(mod)
    assert "R.nn.conv2d(x" not in new.script() and "R.matmul" in new.script()
    assert "R.matmul(x" in mod.script() or "R.nn.conv2d(x" in mod.script()  # the input module is left as it was
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()
    # One 2-D kernel: the GEMM with its whole epilogue; besides it only
    # reshapes (views once built) and the 3x3 convolution.
    kernels = _kernels(_fused(new))
    gemm = [n for n in kernels if n.startswith("fused_matmul")]
    assert len(gemm) == 1, kernels.keys()
    name = gemm[0]
    assert all(op in name for op in (["cast", "add", "add1", "relu"] if make is _bottleneck else ["add"])), name
    assert all(n.startswith(("fused_matmul", "reshape", "conv2d", "transpose", "fused_reshape")) or "gelu" in n
               or "erf" in n or "multiply" in n for n in kernels), kernels.keys()
    text = kernels[name].script()
    assert text.count("T.Buffer((T.int64(70)" if make is _bottleneck else "T.Buffer((T.int64(10)") >= 2  # rows = N*H*W


@pytest.mark.parametrize("why, kwargs", [
    ("a 3x3 kernel", {"k": 3}),
    ("stride 2", {"stride": 2}),
])
def test_other_convolutions_are_left_alone(why, kwargs):
    new = flat_gemm()(_bottleneck(**kwargs))
    assert "R.matmul" not in new.script(), why


def test_a_broadcast_by_the_other_side_stops_the_epilogue():
    """An [N,1,1,C] scale (squeeze-excitation) broadcasts over the rows: the
    epilogue stays 4-D from there, and the result is the same."""
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 4, 4, 16), "float32"), w: R.Tensor((8, 1, 1, 16), "float32"),
             s: R.Tensor((2, 1, 1, 8), "float32")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC")
            z = R.multiply(R.nn.relu(y), s)
            R.output(z)
        return z
""")
    new = flat_gemm()(mod)
    text = new.script()
    assert "R.nn.relu(lv" in text and "R.multiply(" in text
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=1e-5, atol=1e-5)


def test_flat_gemm_phase_and_config():
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"flat_gemm": True}})
    assert [name for name, _ in phases(cfg.cuda)][-2:] == ["flat_gemm", "fusion"]
    fusion = dict(phases(cfg.cuda))["fusion"]
    assert any("RewriteDataflowReshape" in str(p) for p in fusion)  # its reshapes: views, not kernels to tune and schedule
    assert "flat_gemm" not in [name for name, _ in phases(config.from_dict({"model": {"source": "tiny_cnn"}}).cuda)]
    with pytest.raises(ConfigError, match="invalid llvm.flat_gemm"):
        config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"flat_gemm": True}})  # NCHWc there
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"flat_gemm": True, "layout": "NHWC"}})
    assert "flat_gemm" in [name for name, _ in phases(cfg.llvm)]


def test_the_mma_rule_draws_spaces_for_the_flat_gemm_and_not_the_4d_convolution():
    """Why the pass exists: TVM 0.27's mma.sync tiling declines a fused NHWC
    1x1 convolution ("The MMA tensor core only supports SSR loops now": four
    spatial loops, not two), so its design spaces carry no mma.sync; the same
    GEMM flattened to 2-D gets them. Fails once TVM tiles the 4-D
    convolution with mma.sync as well (then the pass is no longer needed for it)."""
    import tvm.s_tir.tensor_intrin  # noqa: F401 - the rules name TVM's tensor intrinsics

    from deploy import targets
    from deploy.tvm_compat import ms

    mod = _bottleneck(n=4, h=56, w=56, c=64, o=256)
    target = targets.resolve("cuda:sm_90").tvm_target()

    def gemm_kernel(m):
        kernels = _kernels(_fused(m))
        (name,) = [n for n in kernels if n.startswith(("fused_conv2d", "fused_matmul"))]
        return tvm.IRModule({"main": kernels[name].with_attr("global_symbol", "main")})

    rules = ms.ScheduleRule.create("cuda-tensorcore")  # [custom, WMMA tiling, mma tiling, SIMT tiling, ...]
    mma_only = [rules[0], rules[2], *rules[3:]]

    def mma_spaces(kernel, seeds=3):
        found = 0
        for seed in range(1, seeds + 1):
            ctx = ms.TuneContext(mod=kernel, target=target, rand_state=seed, space_generator=ms.space_generator.PostOrderApply(
                sch_rules=mma_only, postprocs=[], mutator_probs={}))
            try:
                spaces = ctx.generate_design_space()
            except Exception:  # noqa: BLE001 - a draw that fails gives no space
                continue
            found += sum("mma" in str(sch.trace) for sch in spaces)
        return found

    assert mma_spaces(gemm_kernel(mod)) == 0
    assert mma_spaces(gemm_kernel(flat_gemm()(mod))) >= 2


def test_a_2d_var_never_leaves_its_dataflow_block():
    """A flat GEMM result made inside a dataflow block is not reused by an
    operator after the block (a dataflow var outside its block is an invalid
    module): there the 4-D output is read."""
    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 5, 64), "float32"), w: R.Tensor((64, 48), "float32"), b: R.Tensor((48,), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            y2 = R.nn.relu(y)
            R.output(y2)
        z = R.add(y2, b)
        return z
""")
    new = flat_gemm()(mod)
    assert "R.add(y2, b)" in new.script()
    assert relax.analysis.check_well_formed(new)
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=1e-5, atol=1e-5)


def test_a_feature_map_scaled_by_a_flat_result_is_left_4d():
    """Squeeze-excitation: x[N,H,W,C] * sigmoid(conv1x1(s))[N,1,1,C], the
    flat side first broadcast by the other (whichever operand it is)."""
    for order in ("R.multiply(x, g)", "R.multiply(g, x)"):
        mod = _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((1, 6, 6, 16), "float32"), s: R.Tensor((1, 1, 1, 8), "float32"),
             w: R.Tensor((16, 1, 1, 8), "float32")):
        with R.dataflow():
            e = R.nn.conv2d(s, w, data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC")
            g = R.sigmoid(e)
            z = {order}
            R.output(z)
        return z
""")
        new = flat_gemm()(mod)
        args = _args(mod)
        np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=1e-5, atol=1e-5)


def test_the_reshapes_around_a_flat_gemm_are_not_tuning_tasks():
    """The views the pass leaves become standalone reshape kernels after
    fusion; the build turns them into views, so tuning leaves them out."""
    from deploy import targets
    from deploy.tuning import tasks

    fused = _fused(flat_gemm()(_bottleneck()))
    assert any(n.startswith("reshape") for n in _kernels(fused))
    names = [t.task_name for t in tasks.extract_tasks(fused, targets.resolve("cuda:sm_90").tvm_target())]
    assert names and not [n for n in names if n.startswith("reshape")], names
    assert any(n.startswith("fused_matmul") for n in names)


def _dense_2d():
    """A transformer block's MLP as TVM's importer gives it: 2-D dense layers
    over batch x sequence rows, the output reshaped to [batch, seq, N] for
    GELU and back to 2-D for the next layer, whose output gets the 3-D
    residual."""
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((10, 16), "float32"), w1: R.Tensor((16, 32), "float32"), b1: R.Tensor((32,), "float32"),
             w2: R.Tensor((32, 16), "float32"), r: R.Tensor((2, 5, 16), "float32")):
        with R.dataflow():
            h = R.add(R.matmul(x, w1), b1)
            h3 = R.reshape(h, R.shape([2, 5, 32]))
            g = R.multiply(R.multiply(h3, R.const(0.5, "float32")),
                           R.add(R.erf(R.divide(h3, R.const(1.4142135, "float32"))), R.const(1.0, "float32")))
            g2 = R.reshape(g, R.shape([10, 32]))
            y = R.reshape(R.matmul(g2, w2), R.shape([2, 5, 16]))
            z = R.add(r, y)
            R.output(z)
        return z
""")


def test_a_dense_layers_epilogue_is_carried_in_2d_into_its_gemm_kernel():
    """flat_epilogues() (on by default): GELU between the reshapes and the
    residual add after the second dense layer join their GEMMs' kernels;
    nothing else is rewritten, and the result is the same."""
    from deploy.passes.flat_gemm import flat_epilogues

    mod = _dense_2d()
    new = relax.transform.CanonicalizeBindings()(flat_epilogues()(mod))
    assert relax.analysis.check_well_formed(new)
    args = _args(mod)
    np.testing.assert_allclose(_run(new, args)[0], _run(mod, args)[0], rtol=1e-5, atol=1e-5)
    kernels = _kernels(_fused(new))
    gemms = sorted(n for n in kernels if n.startswith("fused_matmul"))
    assert len(gemms) == 2 and {"erf" in n for n in gemms} == {True, False}, kernels.keys()
    assert all("add" in n for n in gemms) and set(kernels) - set(gemms) <= {"reshape", "reshape1"}, kernels.keys()
    assert not [n for n in kernels if "erf" in n and "matmul" not in n], kernels.keys()
    before = _kernels(_fused(mod))
    assert [n for n in before if "erf" in n and "matmul" not in n], before.keys()  # what it was: GELU alone
    assert "epilogues" in [name for name, _ in phases(config.from_dict({"model": {"source": "tiny_cnn"}}).cuda)]


def test_views_of_two_different_2d_shapes_are_added_as_they_are():
    """Two 2-D tensors of other shapes viewed as the same 3-D shape: the add
    stays 3-D (it cannot be carried in either 2-D shape)."""
    from deploy.passes.flat_gemm import flat_epilogues

    mod = _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(m1: R.Tensor((6, 4), "float32"), m2: R.Tensor((12, 2), "float32")):
        with R.dataflow():
            v = R.reshape(m2, R.shape([2, 6, 2]))
            z = R.add(R.reshape(m1, R.shape([2, 3, 4])), R.reshape(m2, R.shape([2, 3, 4])))
            R.output(z, v)
        return (z, v)
""")
    new = flat_epilogues()(mod)
    args = _args(mod)
    for ref, got in zip(_run(mod, args), _run(new, args)):
        np.testing.assert_array_equal(got, ref)


def _dense_nd(dtype="float16", seq=8, n=64, k=64, acc="float32"):
    """A dense layer as GPT's importer and mixed precision give it:
    [batch, seq, K] @ [K, N] summed in `acc`, cast back, + bias, GELU, the
    matmul 3-D."""
    y = f'R.astype(y, "{dtype}")' if acc != dtype else "y"
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, {seq}, {k}), "{dtype}"), w: R.Tensor(({k}, {n}), "{dtype}"),
             b: R.Tensor(({n},), "{dtype}")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="{acc}")
            z = R.nn.gelu(R.add({y}, b))
            R.output(z)
        return z
""")


def _gemm_kernel(mod):
    """The one matmul kernel of `mod` (fused if it is not yet)."""
    kernels = _kernels(mod) or _kernels(_fused(mod))
    (func,) = [f for f in kernels.values() if "matmul" in f.script()]
    return func


def test_the_nd_matmuls_the_wgmma_kernel_takes_become_2d_gemms():
    """flat_epilogues(wgmma=True) (sm_90, the kernel in use): an N-D matmul
    whose 2-D form the kernel takes (fp16 summed in fp32, rows multiples
    of 16, N and K of 8) becomes one 2-D GEMM kernel with its epilogue,
    computing the same, that the kernel's plan takes (N = 48 too: tiles of
    64 columns, the last 16 past N); the rest is left as it was."""
    from deploy.passes import wgmma_gemm
    from deploy.passes.flat_gemm import flat_epilogues

    mod = _dense_nd()
    new = flat_epilogues(wgmma=True)(mod)
    assert "R.matmul(x" in mod.script() and "R.matmul(x" not in new.script()
    args = _args(mod)
    got, ref = _run(new, args)[0], _run(mod, args)[0]
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()
    kernels = _kernels(_fused(new))
    gemms = [n for n in kernels if n.startswith("fused_matmul")]
    assert len(gemms) == 1 and "add" in gemms[0], kernels.keys()
    assert "T.Buffer((T.int64(16), T.int64(64))" in kernels[gemms[0]].script()  # rows = batch x seq
    assert wgmma_gemm.plan(kernels[gemms[0]]) is not None
    assert wgmma_gemm.plan(_gemm_kernel(mod)) is None  # (what it was: 3-D, not the kernel's)
    assert wgmma_gemm.plan(_gemm_kernel(flat_epilogues(wgmma=True)(_dense_nd(n=48)))).n == 48
    assert "R.matmul(x" not in flat_epilogues(wgmma=True)(_dense_nd(n=40, k=40)).script()
    for why, other in [("rows 10", _dense_nd(seq=5)), ("N 36", _dense_nd(n=36)), ("K 36", _dense_nd(k=36)),
                       ("fp32", _dense_nd("float32", acc="float32")), ("summed in fp16", _dense_nd(acc="float16"))]:
        assert "R.matmul(x" in flat_epilogues(wgmma=True)(other).script(), why
    assert "R.matmul(x" in flat_epilogues()(mod).script()  # (not asked: as before)
    assert wgmma_gemm.fits(16, 48, 64) and wgmma_gemm.fits(16, 40, 24)
    assert not any(wgmma_gemm.fits(*s) for s in [(10, 64, 64), (16, 36, 64), (16, 64, 36)])


@pytest.mark.parametrize("arch, cuda, flat", [
    ("sm_90", {}, True),  # the default: the kernel in use in fp16
    ("sm_90", {"wgmma_gemm": False}, False),
    ("sm_90", {"accumulate": "fp16"}, False),  # (the kernel sums in fp32)
    ("sm_80", {}, False),  # no kernel there: as before
])
def test_the_optimize_stage_flattens_them_where_the_kernel_is_used(arch, cuda, flat):
    from deploy import optimize, targets
    from deploy.passes import wgmma_gemm

    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"precision": "fp16", **cuda}})
    target = targets.resolve(f"cuda:{arch}").tvm_target()
    mod, _ = optimize.optimize_module(_dense_nd("float32", acc="float32"), cfg.cuda, target)
    func = _gemm_kernel(mod)
    assert (len(func.params[0].ty.shape) == 2) == flat, func.script()
    assert (wgmma_gemm.plan(func) is not None) == flat
