"""deploy/passes/unit_batch.py: a GEMM over [1, M, K] rows (a transformer's
dense layer at batch 1) scheduled by our mma.sync GEMM as a 2-D one, the
kernel's parameters unchanged. Checked in emulation on the CPU machine
(tests/cuda_emu.py) against TVM's plain lowering of the kernel as it is."""

import numpy as np
import pytest

from deploy.passes import mma_gemm, schedule, unit_batch
from deploy.tvm_compat import tvm

from .. import emulation


def _i64(x):
    return tvm.tirx.IntImm("int64", x)


def _dense(m=40, n=64, k=64, batch=1, epilogue="bias-square"):
    """ViT's dense layer at batch 1, small: [batch, m, k] fp16 by [k, n],
    summed in fp32, then `epilogue`: "bias-square" (cast, bias, its
    square: fp16), "residual" (cast to fp16 and back, plus an fp32
    [batch, m, n] input) or "" (the fp32 sum is the output)."""
    from tvm import te

    a = te.placeholder((_i64(batch), _i64(m), _i64(k)), "float16", name="A")
    b = te.placeholder((_i64(k), _i64(n)), "float16", name="B")
    r = te.reduce_axis((_i64(0), _i64(k)), name="r")
    c = te.compute((_i64(batch), _i64(m), _i64(n)), lambda x, i, j: te.sum(
        a[x, i, r].astype("float32") * b[r, j].astype("float32"), axis=r), name="C")
    if not epilogue:
        return te.create_prim_func([a, b, c])
    if epilogue == "residual":
        res = te.placeholder((_i64(batch), _i64(m), _i64(n)), "float32", name="res")
        h = te.compute(c.shape, lambda *ix: c[ix].astype("float16"), name="H")
        g = te.compute(c.shape, lambda *ix: res[ix] + h[ix].astype("float32"), name="G")
        return te.create_prim_func([a, b, res, g])
    bias = te.placeholder((_i64(n),), "float16", name="bias")
    h = te.compute(c.shape, lambda *ix: c[ix].astype("float16") + bias[ix[-1]], name="H")
    g = te.compute(c.shape, lambda *ix: h[ix] * h[ix], name="G")
    return te.create_prim_func([a, b, bias, g])


def _shapes(func):
    return [([int(d) for d in p.shape], str(p.dtype)) for p in func.params]


@pytest.mark.parametrize("epilogue", ["bias-square", "residual", ""])
def test_the_kernel_keeps_its_parameters_and_its_blocks_become_2d(epilogue):
    func = _dense(epilogue=epilogue)
    assert mma_gemm.plan(func) is None  # (before: the schedule takes 2-D GEMMs only)
    flat = unit_batch.as_2d(func)
    assert flat is not None and _shapes(flat) == _shapes(func)
    planned = mma_gemm.plan(flat)
    assert planned is not None
    gemm, padding = planned
    assert (gemm.m, gemm.n, gemm.k) == (64, 64, 64) and padding is not None  # (40 rows padded to 64 inside)


@pytest.mark.parametrize("m,epilogue", [(40, "bias-square"), (40, "residual"), (40, ""), (64, "bias-square")],
                         ids=["rows-padded", "residual", "no-epilogue", "rows-tiled"])
def test_the_default_schedule_computes_what_tvms_plain_lowering_does(sm90, m, epilogue):
    """40 rows are padded to 64 inside the schedule (A's 2-D copy inlined
    into the padding); 64 rows stage the copy in shared memory itself."""
    func = _dense(m=m, epilogue=epilogue)
    sch = mma_gemm.Default().apply(func, sm90)
    assert sch is not None
    scheduled = sch.mod["main"]
    assert _shapes(scheduled) == _shapes(func)
    arrays = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, arrays)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), arrays[-1].astype("float32"), rtol=2e-3, atol=2e-3)


def test_it_declines_a_batch_of_more_than_one_and_other_kernels():
    assert unit_batch.as_2d(_dense(batch=2)) is None  # (its output would be written at [i // m, i % m, j])
    assert unit_batch.as_2d(None) is None
    from tvm import te

    x = te.placeholder((_i64(1), _i64(64), _i64(64)), "float16", name="x")
    y = te.compute(x.shape, lambda *ix: x[ix] * x[ix], name="y")  # (a block before the GEMM)
    b = te.placeholder((_i64(64), _i64(64)), "float16", name="B")
    r = te.reduce_axis((_i64(0), _i64(64)), name="r")
    c = te.compute(x.shape, lambda q, i, j: te.sum(y[q, i, r].astype("float32") * b[r, j].astype("float32"), axis=r))
    assert unit_batch.as_2d(te.create_prim_func([x, b, c])) is None


def _first_source(func, target):
    with target:
        sources = schedule._sources(tvm.ir.GlobalVar("fused_dense"), func, None, target, "cuda")
        return next((n, s) for n, s in sources if not isinstance(s, Exception))


def test_the_build_chain_gives_it_our_gemm_before_dlights_matmul(sm90, monkeypatch):
    func = _dense(m=197, n=128, k=64)
    name, scheduled = _first_source(func, sm90)
    assert name == schedule.MMA_GEMM and _shapes(scheduled) == _shapes(func)
    monkeypatch.setattr(unit_batch, "ENABLED", False)  # (the A/B setting: the chain as before)
    assert _first_source(func, sm90)[0] == "dlight.Matmul"


def _two_outputs(batch):
    """A GEMM whose result feeds two outputs: fp16 of it, and its square."""
    from tvm import te

    lead = [_i64(batch)] if batch else []
    a = te.placeholder((*lead, _i64(64), _i64(64)), "float16", name="A")
    b = te.placeholder((_i64(64), _i64(64)), "float16", name="B")
    r = te.reduce_axis((_i64(0), _i64(64)), name="r")
    c = te.compute((*lead, _i64(64), _i64(64)), lambda *ix: te.sum(
        a[(*ix[:-1], r)].astype("float32") * b[r, ix[-1]].astype("float32"), axis=r), name="C")
    h = te.compute(c.shape, lambda *ix: c[ix].astype("float16"), name="H")
    g = te.compute(c.shape, lambda *ix: (c[ix] * c[ix]).astype("float16"), name="G")
    return te.create_prim_func([a, b, h, g])


@pytest.mark.parametrize("batch", [None, 1], ids=["2d", "unit-batch"])
def test_an_epilogue_with_an_output_before_its_last_block_is_declined_not_raised(sm90, batch):
    """The schedule computes the epilogue into its last block: an output
    written by an earlier one is not its kernel (it raised a ScheduleError
    at compute_inline, which the build logged as a fallback)."""
    assert mma_gemm.Default().apply(_two_outputs(batch), sm90) is None


def test_tf32_marks_a_unit_batch_fp32_gemm_and_the_default_computes_it_in_tf32(sm90):
    """passes/tf32.py's marking sees the GEMM as the default does; the
    kernel's result is the TF32 product (operands rounded as loaded)."""
    from tvm import te

    from deploy.passes import tf32

    from .test_mma_emulation import _tf32

    a = te.placeholder((_i64(1), _i64(40), _i64(64)), "float32", name="A")
    b = te.placeholder((_i64(64), _i64(64)), "float32", name="B")
    r = te.reduce_axis((_i64(0), _i64(64)), name="r")
    c = te.compute((_i64(1), _i64(40), _i64(64)), lambda x, i, j: te.sum(a[x, i, r] * b[r, j], axis=r), name="C")
    func = te.create_prim_func([a, b, c])
    marked = tf32.mark()(tvm.IRModule({"main": func}))["main"]
    assert marked.attrs and marked.attrs[tf32.ATTR]
    sch = mma_gemm.Default().apply(marked, sm90)
    assert sch is not None
    arrays = emulation.reference(func)
    got, problems = emulation.run(func, sch.mod["main"], sm90, arrays)
    assert not problems, sorted(problems)[:5]
    want = _tf32(arrays[0][0]) @ _tf32(arrays[1])
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
