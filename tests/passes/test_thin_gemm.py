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
from .test_gpu_default import _first_source
from .test_mma_gemm import _gemm

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
    assert "__shared__ alignas(64) half B_shared_ptr" in src and ("*(uint4*)" in src if k % 8 == 0 else True), src
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, (what, problems)


def _fp32_gemm(m=4096, n=6, k=20):
    """An fp32 GEMM (an fp32 package's) with a bias."""
    from tvm import te

    from .test_mma_gemm import _i64

    a = te.placeholder((_i64(m), _i64(k)), "float32", name="A")
    b = te.placeholder((_i64(k), _i64(n)), "float32", name="B")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")
    c = te.compute((_i64(m), _i64(n)), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    out = te.compute(c.shape, lambda i, j: c[i, j] + bias[j], name="D")
    return te.create_prim_func([a, b, bias, out])


def test_an_fp32_gemm_is_computed_in_fp32_four_lanes_at_once(sm90):
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


def _concatenated_rows(m=4096, n=8, k1=16, k2=16):
    """A GEMM whose A is a concatenation of two inputs along K (a producer reading two buffers)."""
    from tvm import te

    from .test_mma_gemm import _i64

    x1 = te.placeholder((_i64(m), _i64(k1)), "float16", name="X1")
    x2 = te.placeholder((_i64(m), _i64(k2)), "float16", name="X2")
    b = te.placeholder((_i64(k1 + k2), _i64(n)), "float16", name="B")
    a = te.compute((_i64(m), _i64(k1 + k2)), lambda i, c: tvm.tirx.if_then_else(
        c < _i64(k1), x1[i, tvm.tirx.min(c, _i64(k1 - 1))], x2[i, tvm.tirx.max(c - _i64(k1), _i64(0))]), name="A")
    r = te.reduce_axis((_i64(0), _i64(k1 + k2)), name="k")
    c = te.compute((_i64(m), _i64(n)), lambda i, j: te.sum(
        a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r), name="C")
    return te.create_prim_func([x1, x2, b, c])


def test_only_a_row_padding_of_a_is_computed_as_the_row_is_loaded(sm90):
    """A concatenation into A (two inputs: the shared stage would have held
    one of them, not B) is declined; mma_gemm.match takes it."""
    func = _concatenated_rows()
    assert mma_gemm.match(func, multiple=1) is not None
    assert ThinGemm().apply(func, sm90) is None


def test_an_implicit_gemms_gather_is_declined(sm90):
    """A 3x3 convolution to 16 channels as an implicit GEMM (its im2col a
    producer of A, passes/implicit_gemm.py): a thread's rows are gathered,
    not read in vectors. Left to the chain's next rule."""
    from . import test_implicit_gemm as ig

    mod = ig._parse("""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4, 32, 32, 16), "float16"), w: R.Tensor((16, 3, 3, 16), "float16")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1], data_layout="NHWC", kernel_layout="OHWI",
                            out_layout="NHWC", out_dtype="float32")
            z = R.astype(y, "float16")
            R.output(z)
        return z
""")
    kernels = ig._kernels(ig._fused(ig.flat_epilogues(convs=True)(mod)))
    (func,) = [f for n, f in kernels.items() if n.startswith("fused_conv2d_gemm")]
    gemm = mma_gemm.match(func, multiple=1)
    assert gemm is not None and gemm.producers == ["im2col"] and (gemm.m, gemm.n) == (4096, 16)
    assert ThinGemm().apply(func, sm90) is None


def test_the_largest_b_taken_fits_its_static_shared_memory_and_nvcc_compiles_it(sm90):
    from ..conftest import load_script

    n = 16
    k = thin_gemm.MAX_B_BYTES // (2 * n)  # (1,024: at the cap)
    func = _gemm(m=4096, n=n, k=k, padded=4096)
    sch = ThinGemm().apply(func, sm90)
    assert sch is not None
    assert load_script("rule_kernels").nvcc_error(emulation.source(sch.mod["main"], sm90)) is None


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
