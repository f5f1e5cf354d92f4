"""deploy/passes/tf32.py: TF32 tensor cores for fp32 GEMMs where the user
asks for them. On the CPU machine: the fragment layouts against the PTX
ISA's tables (a warp simulated in NumPy), which kernels may use TF32, and
every configuration built for sm_90; on the GPU (`-m gpu`), the kernels
against NumPy."""

import numpy as np
import pytest

from deploy import targets
from deploy.passes import mma_gemm, tf32
from deploy.tuning import builder as tune_builder
from deploy.tvm_compat import tvm


def _i64(x):
    return tvm.tirx.IntImm("int64", x)


def _gemm(m=256, n=256, k=128, b_transposed=False, epilogue=True, marked=True):
    """An fp32 GEMM (B stored [K, N], or [N, K]), then a bias and a ReLU;
    with passes/tf32.py's attribute where `marked`."""
    from tvm import te

    a = te.placeholder((_i64(m), _i64(k)), "float32", name="A")
    b = te.placeholder((_i64(n), _i64(k)) if b_transposed else (_i64(k), _i64(n)), "float32", name="B")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")
    c = te.compute((_i64(m), _i64(n)), lambda i, j: te.sum(a[i, r] * (b[j, r] if b_transposed else b[r, j]), axis=r),
                   name="C")
    if epilogue:
        h = te.compute(c.shape, lambda i, j: tvm.tirx.max(c[i, j] + bias[j], tvm.tirx.const(0, "float32")), name="H")
        func = te.create_prim_func([a, b, bias, h])
    else:
        func = te.create_prim_func([a, b, c])
    return func.with_attr(tf32.ATTR, True) if marked else func


# The PTX ISA's tables ("Matrix Fragments for mma.m16n8k8", .tf32; g = lane / 4,
# t = lane % 4), written out here independently of passes/tf32.py.
def _isa_a(lane, i):  # a0..a3 of the 16x8 A: (row, col)
    return lane // 4 + 8 * (i % 2), lane % 4 + 4 * (i // 2)


def _isa_b(lane, i):  # b0, b1 of the 8x8 B: (k, n)
    return lane % 4 + 4 * i, lane // 4


def _isa_c(lane, i):  # c0..c3 of the 16x8 C: (row, col)
    return lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2


def _ldmatrix_x4(tile, address_of):
    """`ldmatrix.sync.aligned.m8n8.x4.shared.b16` of 32-bit values: lanes 8m
    to 8m + 7 give the rows of matrix m ([row, col] of 4 consecutive
    words each); lane L receives in register m the word L % 4 of that
    matrix's row L / 4. Returns [32 lanes, 4 registers]."""
    out = np.zeros((32, 4), tile.dtype)
    for lane in range(32):
        for m in range(4):
            r, c = address_of(8 * m + lane // 4)
            out[lane, m] = tile[r, c + lane % 4]
    return out


def test_the_fragments_compute_a_16x16x16_tile_as_the_isa_says():
    """A warp simulated from the ISA's tables: A and B loaded as the
    intrinsics load them, the four m16n8k8 as `mma_offsets` issues them,
    C read back through its layout: A @ B, for B stored either way. And
    each layout the intrinsics' descriptions give is where the loads put
    each element."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)), rng.standard_normal((16, 16))
    regs_a = np.concatenate([_ldmatrix_x4(a, lambda tx, s=s: tf32.a_ldmatrix_row_col(tx, s)) for s in range(2)], 1)
    regs_b_nk = np.concatenate([_ldmatrix_x4(b.T, lambda tx, h=h: tf32.b_nk_ldmatrix_row_col(tx, h))
                                for h in range(2)], 1)
    regs_b_kn = np.array([[b[tf32.b_kn_element(lane, r)] for r in range(8)] for lane in range(32)])
    for i in range(16):
        for k in range(16):
            assert regs_a[tf32.a_layout(i, k)] == a[i, k]
            assert regs_b_nk[tf32.b_layout(k, i)] == regs_b_kn[tf32.b_layout(k, i)] == b[k, i]
    for regs_b in (regs_b_nk, regs_b_kn):
        regs_c = np.zeros((32, 8))
        for half in range(2):
            for step in range(2):
                oa, ob, oc = tf32.mma_offsets(half, step)
                a8, b8 = np.zeros((16, 8)), np.zeros((8, 8))
                for lane in range(32):
                    for i in range(4):
                        a8[_isa_a(lane, i)] = regs_a[lane, oa + i]
                    for i in range(2):
                        b8[_isa_b(lane, i)] = regs_b[lane, ob + i]
                c8 = a8 @ b8
                for lane in range(32):
                    for i in range(4):
                        regs_c[lane, oc + i] += c8[_isa_c(lane, i)]
        got = np.array([[regs_c[tf32._c_layout(i, j)] for j in range(16)] for i in range(16)])
        np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_an_fp32_gemm_takes_tf32_only_where_it_is_marked():
    """A strict-fp32 package never gets a TF32 kernel: `match` takes an fp32
    GEMM only with the attribute, which `mark` gives the GEMMs it would take."""
    assert mma_gemm.match(_gemm(marked=False)) is None
    got = mma_gemm.match(_gemm())
    assert (got.m, got.n, got.k, got.dtype, got.epilogue) == (256, 256, 128, "float32", ["H"])
    assert mma_gemm.match(_gemm(b_transposed=True)).b_transposed
    mod = tvm.IRModule({"gemm": _gemm(marked=False), "padded": _gemm(m=200, marked=False),
                        "gemv": _gemm(m=16, marked=False)})
    marked = tf32.mark()(mod)
    assert marked["gemm"].attrs[tf32.ATTR] and marked["padded"].attrs[tf32.ATTR]  # (200 rows: padded in the kernel)
    assert tf32.ATTR not in (marked["gemv"].attrs or {})


def test_the_default_tile_fits_the_architectures_shared_memory(sm90):
    """fp32 tiles take twice an fp16's shared memory: 128x128 tiles in four
    stages with an epilogue (212,992 bytes) fit an H100/H200's 232,448 but
    not an A100's 166,912."""
    gemm = mma_gemm.match(_gemm(m=4096, n=4096, k=512, b_transposed=True))
    assert mma_gemm.shared_bytes(gemm, "128x128x32-w2x2-s4") == 4 * (128 * 36 * 2) * 4 + 128 * 128 * 4
    assert mma_gemm.default_config(gemm, sm90) == "128x128x32-w2x2-s4"
    sm80 = targets.resolve("cuda:sm_80").tvm_target()
    assert mma_gemm.default_config(gemm, sm80) == "128x64x32-w2x2-s4"
    fp16 = mma_gemm.Gemm("C", 4096, 4096, 512, True, [], ["H"])
    assert mma_gemm.default_config(fp16, sm80) == "128x128x32-w2x2-s4"


@pytest.mark.parametrize("b_transposed,epilogue", [(False, True), (True, True), (False, False)],
                         ids=["KN-epilogue", "NK-epilogue", "KN"])
def test_every_configuration_builds_for_sm90_with_tf32_mma(sm90, b_transposed, epilogue):
    """Built as the tuner builds a candidate: cp.async, ldmatrix for A (and
    for B stored [N, K]), `mma.sync` in TF32, dynamic shared memory."""
    func = _gemm(b_transposed=b_transposed, epilogue=epilogue)
    spaces = mma_gemm.spaces(func, sm90)
    assert len(spaces) == len(mma_gemm.configs_for(mma_gemm.match(func)))
    for sch in spaces:
        src = tune_builder.lean_build(sch.mod, sm90, None).imports[0].inspect_source()
        name = mma_gemm.config_of(sch.mod)
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src and "cp.async.cg" in src, name
        assert "m16n8k16" not in src and "extern __shared__" in src
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src, name
        # B stored [N, K] loaded by ldmatrix, B stored [K, N] a word at a time
        assert ('"=r"(((unsigned *)(B_shared_dyn_warp_ptr' in src) == b_transposed, name
        assert src.count("+ (uint)4096)") >= 16, name  # (each fragment value rounded: ROUND)


def test_a_strict_fp32_gemm_builds_without_tensor_cores(sm90):
    """The same GEMM unmarked: the build chain gives it no TF32 kernel."""
    from deploy.passes import schedule

    for name, rule in schedule.rules("cuda"):
        if name == schedule.MMA_GEMM:
            assert rule.apply(_gemm(marked=False), sm90) is None
            assert rule.apply(_gemm(), sm90) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("b_transposed", [False, True], ids=["KN", "NK"])
def test_every_configuration_computes_the_gemm_in_tf32(sm90, b_transposed):
    """On the GPU, each configuration against NumPy: within TF32's error of
    the exact product; and TF32 rounded to nearest: 1 + 3 * 2^-12 (0.75 of
    TF32's unit at 1) becomes 1 + 2^-10, where strict fp32 keeps it and
    truncation makes it 1."""
    m, n, k = 512, 384, 256
    func = _gemm(m=m, n=n, k=k, b_transposed=b_transposed, epilogue=False)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype("float32")
    b = rng.standard_normal((n, k) if b_transposed else (k, n)).astype("float32")
    bk = b.T if b_transposed else b
    exact = a.astype("float64") @ bk.astype("float64")
    ones = np.full((m, k), 1 + 3 * 2.0 ** -12, "float32")
    dev = tvm.cuda(0)
    spaces = mma_gemm.spaces(func, sm90)
    assert spaces
    for sch in spaces:
        lib = tune_builder.lean_build(sch.mod, sm90, None)
        name = mma_gemm.config_of(sch.mod)
        out = tvm.runtime.tensor(np.zeros((m, n), "float32"), dev)
        lib["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), out)
        got = out.numpy()
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2e-3, name
        lib["main"](tvm.runtime.tensor(ones, dev), tvm.runtime.tensor(np.ones_like(b), dev), out)
        np.testing.assert_array_equal(out.numpy(), np.full((m, n), k * (1 + 2.0 ** -10), "float32"), err_msg=name)


def test_the_fragments_round_to_nearest_tf32():
    """`rounded`, the expression the loads apply, run on the CPU, then
    `mma.sync`'s truncation of the 13 low bits: TF32's nearest value, within
    half a unit in the last place (2^-11 of the value), no bias (truncation
    alone is off by up to a whole unit, always toward zero); infinities and
    NaNs as they were (the GPU's NaN, 0x7FFFFFFF, plus ROUND would read as
    -0); fp32's largest rounds to infinity."""
    from tvm import te

    special = np.array([0x7F800000, 0xFF800000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F7FFFFF, 0, 0x80000000,
                        0x00000001], "uint32").view("float32")
    x = np.concatenate([np.random.default_rng(1).standard_normal(100_000).astype("float32"), special])
    a = te.placeholder((x.size,), "float32", name="A")
    b = te.compute(a.shape, lambda i: tf32.rounded(a[i]), name="B")
    lib = tvm.tirx.build(tvm.IRModule({"main": te.create_prim_func([a, b]).with_attr("global_symbol", "main")}),
                         target="llvm")
    out = tvm.runtime.tensor(np.zeros_like(x))
    lib["main"](tvm.runtime.tensor(x), out)
    got = (out.numpy().view("uint32") & np.uint32(0xFFFFE000)).view("float32")  # (what the tensor core reads)
    finite, rest = got[:-special.size], got[-special.size:]
    err = (finite.astype("float64") - x[:-special.size]) / np.abs(x[:-special.size])
    assert np.abs(err).max() <= 2.0 ** -11 and abs(err.mean()) < 1e-5
    truncated = (x[:-special.size].view("uint32") & np.uint32(0xFFFFE000)).view("float32")
    assert ((truncated.astype("float64") - x[:-special.size]) / np.abs(x[:-special.size])).min() < -0.9 * 2.0 ** -10
    assert list(rest[:2]) == [np.inf, -np.inf] and np.isnan(rest[2:5]).all()
    assert rest[5] == np.inf and list(rest[6:8].view("uint32")) == [0, 0x80000000] and rest[8] == 0


def test_the_kernel_check_judges_a_tf32_kernel_by_tf32s_tolerance():
    """tuning/check.py: an fp32 output 2e-3 off its strict-fp32 reference
    fails an fp32 kernel's check and passes a TF32 one's."""
    from deploy.tuning import check

    want = np.random.default_rng(2).standard_normal(1000).astype("float32")
    got = want * np.float32(1 + 2e-3)
    buffers = [("argument 0", "float32", [1000])]
    assert not check._worst(buffers, [got], [want])["ok"]
    assert check._worst(buffers, [got], [want], tf32=True)["ok"]
    assert not check._worst(buffers, [want * np.float32(1.01)], [want], tf32=True)["ok"]


def test_tf32_is_refused_where_it_would_silently_run_strict_fp32(capsys, tmp_path):
    """Below sm_80 (no cp.async pipeline for our schedule) and outside NHWC
    (convolutions become GEMMs in NHWC only): one line, exit 2, nothing left
    half-written."""
    from deploy import cli

    from ..test_errors import error_line

    rc = cli.main(["run", "-m", "tiny_mlp", "--target", "cuda:sm_75", "--precision", "tf32", "--workdir",
                   str(tmp_path / "ws"), "--db-root", str(tmp_path / "db")])
    assert rc == 2 and "sm_80 or later" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "ws" / "package").exists() and not (tmp_path / "ws" / "optimize").exists()
    with pytest.raises(Exception, match="NHWC only"):
        from deploy import config

        config.from_dict({"model": {"source": "x"}, "cuda": {"precision": "tf32", "layout": "NCHW"}})


def test_a_tf32_profile_says_its_convolutions_are_gemms():
    """What the run prints and the manifest records: flat and implicit GEMMs
    on, from a config file or the command line."""
    from deploy import config

    for cfg in (config.from_dict({"model": {"source": "x"}, "cuda": {"precision": "tf32"}}),
                config.apply_overrides(config.from_dict({"model": {"source": "x"}}), "cuda", precision="tf32")):
        p = cfg.profile("cuda")
        assert (p.precision, p.flat_gemm, p.implicit_gemm) == ("tf32", True, True)
    default = config.from_dict({"model": {"source": "x"}}).profile("cuda")  # (fp16: on sm_90, as databases allow)
    assert default.implicit_gemm is None and default.implicit_gemms(True) and not default.implicit_gemms(True, True)
