"""deploy/passes/thin_gemm.py: GEMMs with many rows and few columns a
thread a row, on the CPU machine (emulated: tests/emulation.py) and, with
`-m gpu`, on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import targets
from deploy.passes import mma_gemm, schedule, thin_gemm
from deploy.passes.thin_gemm import ThinGemm
from deploy.tvm_compat import tvm

from .. import emulation
from .test_mma_gemm import _gemm


@pytest.fixture(scope="module")
def sm90():
    return targets.resolve("cuda:sm_90").tvm_target()


def _first_source(func, target):
    gv = tvm.ir.GlobalVar("main")
    return next(s for s in schedule._sources(gv, func, None, target, "cuda") if not isinstance(s[1], Exception))


# (m, n, k, b_transposed, epilogue, padded rows: a producer before the GEMM)
CASES = [
    ("U-Net's head: 3 classes", 4096, 3, 32, False, True, 4096),
    ("a projection to 16 channels, 4 columns a thread", 4096, 16, 32, False, True, 4096),
    ("24 channels over K = 96, a transposed weight", 4096, 24, 96, True, True, 4096),
    ("no epilogue: the fp32 sums are the output", 4096, 8, 40, False, False, 4096),
    ("a padded input (a producer) and K no vector divides", 4100, 6, 18, False, True, 4104),
    ("21 classes, 7 columns a thread", 4096, 21, 64, False, True, 4096),
]


@pytest.mark.parametrize("what, m, n, k, b_transposed, epilogue, padded", CASES, ids=[c[0] for c in CASES])
def test_a_thin_gemm_gets_a_thread_a_row_and_computes_what_tvms_plain_lowering_does(
        sm90, what, m, n, k, b_transposed, epilogue, padded):
    """Bit for bit (each output's fp32 sum in K's order, as the plain
    lowering's), its row read in vectors, B from shared memory."""
    func = _gemm(m=m, n=n, k=k, padded=padded, b_transposed=b_transposed, epilogue=epilogue)
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.THIN_GEMM, what
    cols = thin_gemm.columns_a_thread(padded, n)
    grid, block, _ = emulation.launch(scheduled, sm90)
    assert block == (thin_gemm.THREADS, 1) and grid == -(-padded * (n // cols) // thin_gemm.THREADS), what
    src = emulation.source(scheduled, sm90)
    assert "__shared__" in src and ("*(uint4*)" in src if k % 8 == 0 else True), src
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, (what, problems)


def _fp32_gemm(m=4096, n=6, k=20):
    """A TF32-marked fp32 GEMM (PRECISION=tf32's) with a bias: computed in strict fp32 here."""
    from tvm import te

    from deploy.passes import tf32

    from .test_mma_gemm import _i64

    a = te.placeholder((_i64(m), _i64(k)), "float32", name="A")
    b = te.placeholder((_i64(k), _i64(n)), "float32", name="B")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")
    c = te.compute((_i64(m), _i64(n)), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    out = te.compute(c.shape, lambda i, j: c[i, j] + bias[j], name="D")
    return te.create_prim_func([a, b, bias, out]).with_attr(tf32.ATTR, True)


def test_a_tf32_marked_fp32_gemm_is_computed_in_fp32_four_lanes_at_once(sm90):
    func = _fp32_gemm()
    scheduled = ThinGemm().apply(func, sm90).mod["main"]
    src = emulation.source(scheduled, sm90)
    assert "*(float4*)" in src and "mma" not in src, src
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, problems


@pytest.mark.parametrize("m, n, want", [(2097152, 3, 3), (401408, 16, 16), (12544, 16, 4), (3136, 24, 4),
                                        (4096, 6, 6), (8192, 21, 7), (16384, 24, 6)])
def test_few_rows_split_their_columns_over_threads(m, n, want):
    assert thin_gemm.columns_a_thread(m, n) == want


@pytest.mark.parametrize("what, kwargs", [
    ("as many columns as our mma.sync GEMM takes", dict(m=4096, n=mma_gemm.SMALL_COLS, k=32)),
    ("too few rows", dict(m=thin_gemm.MIN_ROWS - 64, n=8, k=32)),
    ("a long reduction", dict(m=4096, n=8, k=thin_gemm.MAX_K + 64)),
    ("a B larger than its shared memory stage", dict(m=4096, n=31, k=thin_gemm.MAX_K)),
])
def test_other_gemms_are_not_taken(sm90, what, kwargs):
    func = _gemm(padded=kwargs["m"], **kwargs)
    assert ThinGemm().apply(func, sm90) is None, what


def test_dlight_pads_the_columns_to_its_64_column_tile(sm90):
    """Why the rule exists: DLight's Matmul computes a 3-column GEMM in
    tiles of 64 columns. Fails once DLight schedules it otherwise; then
    look again at whether the rule is still needed."""
    from deploy.tvm_compat import dlight

    func = _gemm(m=4096, n=3, k=32, padded=4096)
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul())(tvm.IRModule({"main": func}))
    assert "T.int64(64)), scope=\"local\")" in mod["main"].script() or "T.int64(64)), \"float16\", scope=\"shared\")" \
        in mod["main"].script(), mod["main"].script()


def test_the_switch_turns_the_rule_off(sm90, monkeypatch):
    func = _gemm(m=4096, n=3, k=32, padded=4096)
    monkeypatch.setattr(thin_gemm, "THIN_GEMM", False)
    assert _first_source(func, sm90)[0] == "dlight.Matmul"


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(2097152, 3, 32), (401408, 16, 32), (12544, 16, 32), (100352, 24, 144)])
def test_gpu_a_thin_gemm(sm90, m, n, k):
    from deploy.build import build_kernel

    func = _gemm(m=m, n=n, k=k, padded=m)
    args = emulation.reference(func)
    lib = build_kernel("k", ThinGemm().apply(func, sm90).mod["main"], targets.resolve("cuda:sm_90"))
    got = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in args[:-1]] + [
        tvm.runtime.tensor(np.zeros_like(args[-1]), tvm.cuda(0))]
    lib["k"](*got)
    np.testing.assert_allclose(got[-1].numpy().astype("float32"), args[-1].astype("float32"), rtol=2e-3, atol=2e-3)
