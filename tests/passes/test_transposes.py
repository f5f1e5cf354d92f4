"""deploy/passes/transposes.py: transposes that undo each other go, the
residual add of two transposed tensors becomes one transpose, every value
bit for bit as it was; and ConvNeXt's block keeps no transpose."""

from __future__ import annotations

from deploy.passes.transposes import cancel_transposes

from .test_flat_gemm import _parse
from .test_movement import _assert_bit_exact


def _residual():
    """A ConvNeXt block's shape of graph once its convolution is NHWC: the
    residual stream in NCHW, its add between two transposes, then back."""
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 5, 6, 8), "float16"), y: R.Tensor((2, 5, 6, 8), "float16")):
        with R.dataflow():
            a = R.permute_dims(x, axes=[0, 3, 1, 2])
            b = R.permute_dims(y, axes=[0, 3, 1, 2])
            s = R.add(a, b)
            t = R.permute_dims(s, axes=[0, 2, 3, 1])
            u = R.permute_dims(t, axes=[0, 1, 2, 3])
            v = R.multiply(u, R.const(2.0, "float16"))
            R.output(v)
        return v
""")


def test_the_residual_add_meets_its_transposes_and_they_go():
    mod = _residual()
    new = cancel_transposes()(mod)
    assert "R.permute_dims" not in new.script()
    _assert_bit_exact(mod, new)


def _composed():
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 3, 4, 5), "float32")):
        with R.dataflow():
            a = R.permute_dims(x, axes=[0, 2, 3, 1])
            b = R.permute_dims(a, axes=[3, 0, 2, 1])
            c = R.permute_dims(x)
            d = R.permute_dims(c, axes=[1, 0, 2, 3])
            R.output(b, d)
        return (b, d)
""")


def test_two_transposes_become_one_that_computes_the_same():
    mod = _composed()
    new = cancel_transposes()(mod)
    assert new.script().count("R.permute_dims") == 2
    _assert_bit_exact(mod, new)


def _mixed():
    """Transposes that do not match: different permutations, or a
    broadcast operand: left as they are."""
    return _parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((3, 3, 3), "float32"), y: R.Tensor((3, 3, 3), "float32"), z: R.Tensor((3, 3, 1), "float32")):
        with R.dataflow():
            a = R.permute_dims(x, axes=[2, 1, 0])
            b = R.permute_dims(y, axes=[2, 0, 1])
            c = R.permute_dims(y, axes=[2, 1, 0])
            s = R.add(a, R.permute_dims(b, axes=[1, 0, 2]))
            t = R.add(c, z)
            R.output(s, t)
        return (s, t)
""")


def test_what_does_not_cancel_is_left_and_still_exact():
    mod = _mixed()
    new = cancel_transposes()(mod)
    _assert_bit_exact(mod, new)
    assert new.script().count("R.permute_dims") == 3  # a, b and its permute made one, c


def test_convnext_keeps_no_transpose_but_its_input_layout_change(tmp_path):
    """The optimize stage on ConvNeXt-T (CUDA, fp16, NHWC): before this pass
    the small variant had 15 kernels that transpose (alone or fused); now only
    the input's NCHW -> NHWC change is left."""
    from deploy import config, export, frontend, optimize, targets
    from deploy.tvm_compat import relax, tirx

    cfg = config.from_dict({"model": {"source": "convnext", "size": "small"},
                            "cuda": {"buckets": [1], "tune_buckets": [1], "trials": 0}})
    fe = frontend.run(cfg.cuda, export.run(cfg, tmp_path / "export"), tmp_path / "frontend")
    mod, _ = optimize.optimize_module(fe.load_module(1), cfg.cuda, targets.resolve("cuda:sm_90").tvm_target())
    names = [gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)]
    # (the input's change, its stem's 3 channels padded to 8 with it where the stem is an implicit GEMM)
    assert [n for n in names if "transpose" in n] == ["fused_transpose_cast_pad"], names
    assert isinstance(mod["main"], relax.Function)


def _mixer(identity: bool):
    """MLP-Mixer's shape of residual: both operands transposed, but the sum
    meets no transpose and one operand is read again; with `identity`, an
    identity permute beside it (which goes)."""
    z, i = (', z: R.Tensor((2, 3, 4), "float32")', "i = R.permute_dims(z, axes=[0, 1, 2])") if identity else ("", "")
    out = "s, m, i" if identity else "s, m"
    return _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((2, 3, 4), "float32"), y: R.Tensor((2, 3, 4), "float32"){z}):
        with R.dataflow():
            a = R.permute_dims(x, axes=[0, 2, 1])
            b = R.permute_dims(y, axes=[0, 2, 1])
            s = R.add(a, b)
            m = R.sum(a, axis=[1])
            {i}
            R.output({out})
        return ({out})
""")


def test_a_function_where_nothing_cancels_is_left_as_it_was():
    """Moving the add behind one transpose would leave as many transposes
    (and split TVM's fusion)."""
    import tvm_ffi

    mod = _mixer(identity=False)
    assert tvm_ffi.structural_equal(cancel_transposes()(mod), mod)


def test_an_add_that_gains_nothing_stays_though_the_function_loses_transposes():
    """The function has fewer transposes (the identity goes), but its add
    keeps its place: each rewrite pays for itself, not only the function's
    sum."""
    mod = _mixer(identity=True)
    new = cancel_transposes()(mod)
    text = new.script()
    assert text.count("R.permute_dims") == 2 and "R.add(a, b)" in text
    _assert_bit_exact(mod, new)
