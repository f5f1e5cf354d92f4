"""passes/wgmma_gemm.py: a model's fp16 GEMM kernels as our TIRx wgmma kernel
(--wgmma-gemm). On the CPU machine: what the plan takes from a fused GEMM
function is checked by running its meaning in plain TIR (the same epilogue
text, a naive product) against the function itself on LLVM; the kernel is
built for sm_90a and nvcc compiles it; a module holding it beside other
kernels compiles through our TIR pipeline. On the GPU (`-m gpu`) the
kernels compute what NumPy computes."""

import re
import string

import numpy as np
import pytest

from deploy.passes import wgmma_gemm

from .. import emulation

# The plan's meaning in plain TIR: the product by a loop, then the epilogue text the kernel applies
_MEANING = string.Template('''
@T.prim_func
def main($params):
    wg_acc = T.alloc_buffer((1,), "float32")
    for wg_row in range($m):
        for wg_colc in range($n):
            wg_acc[0] = T.float32(0)
            for wg_k in range($k):
                wg_acc[0] = wg_acc[0] + T.Cast("float32", $aload) * T.Cast("float32", $bload)
            wg_x = T.meta_var(wg_acc[0])
            $out[wg_row, wg_colc] = T.Cast("$out_dtype", $expr)
''')


def _gemm(m, n, k, epilogue, b_kn=True, pad_to=None):
    """A fused GEMM function as the optimize stage makes them: fp16 A [m, k]
    (its rows padded to `pad_to` inside, as pad_gemm does), B [k, n] or
    [n, k], fp32 product, then `epilogue`: bias (cast, + bias), gelu (the
    exported erf form in fp16, on the bias), residual (cast, + bias, to fp32,
    + an fp32 residual), or none (the fp32 product is the output)."""
    from tvm import te, tirx

    a = te.placeholder((m, k), "float16", name="a")
    b = te.placeholder((k, n) if b_kn else (n, k), "float16", name="w")
    rows = pad_to or m
    src = a if pad_to is None else te.compute(
        (rows, k), lambda i, j: tirx.if_then_else(i < m, a[i, j], tirx.const(0, "float16")), name="a_pad")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((rows, n), lambda i, j: te.sum(
        src[i, r].astype("float32") * (b[r, j] if b_kn else b[j, r]).astype("float32"), axis=r), name="c")
    if pad_to is not None:
        c = te.compute((m, n), lambda i, j: c[i, j], name="c_unpad")
    if epilogue == "none":
        return te.create_prim_func([a, b, c])
    bias = te.placeholder((n,), "float16", name="bias")
    h = te.compute((m, n), lambda i, j: c[i, j].astype("float16") + bias[j], name="h")
    if epilogue == "bias":
        return te.create_prim_func([a, b, bias, h])
    if epilogue == "gelu":
        half = "float16"
        s = te.compute((m, n), lambda i, j: h[i, j] / tirx.const(1.4142135623730951, half), name="s")
        e = te.compute((m, n), lambda i, j: te.erf(s[i, j].astype("float32")).astype(half) + tirx.const(1, half),
                       name="e")
        g = te.compute((m, n), lambda i, j: h[i, j] * e[i, j] * tirx.const(0.5, half), name="g")
        return te.create_prim_func([a, b, bias, g])
    res = te.placeholder((m, n), "float32", name="res")
    out = te.compute((m, n), lambda i, j: res[i, j] + h[i, j].astype("float32"), name="out")
    return te.create_prim_func([a, b, bias, res, out])


def _meaning(p):
    from tvm.script import tirx as T

    from deploy.tvm_compat import tvm

    params = ", ".join(f'{name}: T.Buffer({tuple(shape)}, "{dtype}")' for name, shape, dtype in p.params)
    out_dtype = next(dtype for name, _, dtype in p.params if name == p.out)
    bload = f"{p.b}[wg_k, wg_colc]" if p.b_kn else f"{p.b}[wg_colc, wg_k]"
    aload = f"{p.a}[wg_row, wg_k]"
    if p.gather is not None:  # (as the kernel copies it: 8 elements from the gather's offset at k - k % 8)
        g = p.gather
        _, h, w, c = next(shape for name, shape, _ in p.params if name == p.a)

        def at_chunk(t):
            t = t.replace("wg_arow", "wg_row").replace("wg_ak", "(wg_k - wg_k % 8)")
            return t if g.dtype == "int32" else t.replace("wg_row", 'T.Cast("int64", wg_row)')
        off = f"({at_chunk(g.row_offset)}) + ({at_chunk(g.k_offset)}) + wg_k % 8"
        holds = [at_chunk(g.row_cond), at_chunk(g.k_cond), *(f"0 <= ({at_chunk(r)}) + ({at_chunk(q)}) and "
                                                              f"({at_chunk(r)}) + ({at_chunk(q)}) < {size}"
                                                              for r, q, size in g.checks)]
        index = f"({off}) // {h * w * c}, ({off}) // {w * c} % {h}, ({off}) // {c} % {w}, ({off}) % {c}"
        aload = f"T.if_then_else({' and '.join(f'({t})' for t in holds)}, {p.a}[{index}], T.float16(0))"
    text = _MEANING.substitute(params=params, m=p.m, n=p.n, k=p.k, aload=aload, bload=bload, out=p.out,
                               out_dtype=out_dtype, expr=p.expr)
    return tvm.script.from_source(text, extra_vars={"T": T})


@pytest.mark.parametrize("epilogue,b_kn,pad,n", [("gelu", True, 128, 64), ("residual", True, None, 64),
                                                 ("bias", False, None, 64), ("none", True, None, 64),
                                                 ("residual", True, None, 96)])
def test_the_plan_means_what_the_function_computes(epilogue, b_kn, pad, n):
    """The plan's A, B, output, B layout and epilogue text, run as plain TIR
    on LLVM, compute what the fused function computes (a ViT fc1 with its
    rows padded, a residual in fp32, B stored [N, K], no epilogue, N = 96)."""
    func = _gemm(112, n, 48, epilogue, b_kn=b_kn, pad_to=pad)
    p = wgmma_gemm.plan(func)
    assert p is not None and (p.a, p.b, p.m, p.n, p.k, p.b_kn) == ("a", "w", 112, n, 48, b_kn)
    assert "wg_x" in p.expr
    want = emulation.reference(func)  # (both on the same seeded inputs: the meaning takes the function's parameters)
    got = emulation.reference(_meaning(p))
    assert all(np.array_equal(x, y) for x, y in zip(want[:-1], got[:-1]))
    np.testing.assert_allclose(got[-1].astype("float32"), want[-1].astype("float32"), rtol=1e-3, atol=1e-3)


def _conv(n, hw, c, o, k, stride, residual=False, pad=None):
    """A fused implicit GEMM as the optimize stage makes it with
    --implicit-gemm (passes/implicit_gemm.py): a k x k NHWC convolution
    (padding k // 2, or `pad`: top, left, bottom, right) with ResNet's
    epilogue (bias, a residual, ReLU)."""
    from deploy.passes.flat_gemm import flat_gemm

    from .test_flat_gemm import _fused, _kernels, _parse

    pad = list(pad or [k // 2] * 4)
    ho = (hw + pad[0] + pad[2] - k) // stride + 1
    res = f", r: R.Tensor(({n}, {ho}, {ho}, {o}), \"float16\")" if residual else ""
    mod = _parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(({n}, {hw}, {hw}, {c}), "float16"), w: R.Tensor(({o}, {k}, {k}, {c}), "float16"),
             b: R.Tensor((1, 1, 1, {o}), "float16"){res}):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides=[{stride}, {stride}], padding={pad}, data_layout="NHWC",
                            kernel_layout="OHWI", out_layout="NHWC", out_dtype="float32")
            z = R.add(R.astype(y, "float16"), b)
            z = R.nn.relu({"R.add(z, r)" if residual else "z"})
            R.output(z)
        return z
""")
    kernels = _kernels(_fused(flat_gemm(convs=True)(mod)))  # (as with --flat-gemm: the strided 1x1 one too)
    (name,) = [name for name in kernels if "conv2d_gemm" in name]
    return kernels[name].with_attr("global_symbol", "main")


def _implicit(shape):
    """`_conv(*shape)`; with 24 images, its rows (1,176) padded to 1,280 by pad_gemm."""
    from deploy.passes.pad_gemm import pad_prim_func

    func = _conv(*shape)
    if shape[0] == 24:
        func = pad_prim_func(func)
        assert func is not None
    return func


@pytest.mark.parametrize("shape", [(2, 8, 64, 64, 3, 1, False), (2, 16, 64, 128, 3, 2, True), (3, 8, 16, 64, 1, 2, False),
                                   (24, 7, 64, 64, 3, 1, False)],
                         ids=["3x3", "3x3-stride2-residual", "1x1-stride2", "3x3-rows-padded"])
def test_an_implicit_gemms_gather_means_what_the_function_computes(shape):
    """An implicit GEMM (A gathered from the activations: the padding, the
    stride, the channels) is planned as a gather, and the plan, with A read
    as the kernel copies it (8 elements side by side from the gather's
    index at each multiple of 8 of K), computes what the function computes;
    also where pad_gemm padded its rows (24 x 7 x 7 = 1,176 to 1,280)."""
    func = _implicit(shape)
    p = wgmma_gemm.plan(func, gather=True)
    assert p is not None and p.gather is not None and p.a == "x" and not p.b_kn
    want = emulation.reference(func)
    got = emulation.reference(_meaning(p))
    assert all(np.array_equal(x, y) for x, y in zip(want[:-1], got[:-1]))
    np.testing.assert_allclose(got[-1].astype("float32"), want[-1].astype("float32"), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("k, stride", [(2, 1), (3, 2)])
def test_a_gather_with_padding_only_at_the_end_checks_it_where_rows_are_padded(k, stride):
    """Padding only below and right (ONNX's SAME_UPPER, a 2x2 kernel's
    'same'): the first rows never leave the image, the last ones do; with
    pad_gemm's padded rows past them (whose row condition is false), a
    sample of rows could miss the rows that leave it. Every index that
    leaves the image on some row and K is checked, and the plan computes
    what the function computes."""
    from deploy.passes.pad_gemm import pad_prim_func

    func = pad_prim_func(_conv(3, 56, 64, 64, k, stride, pad=(0, 0, 1, 1)))
    assert func is not None
    p = wgmma_gemm.plan(func, gather=True)
    assert p is not None and sorted(size for _, _, size in p.gather.checks) == [56, 56], p.gather.checks
    want = emulation.reference(func)
    got = emulation.reference(_meaning(p))
    np.testing.assert_allclose(got[-1].astype("float32"), want[-1].astype("float32"), rtol=1e-3, atol=1e-3)


def test_a_gather_whose_copies_would_not_lie_side_by_side_is_declined():
    """A gather whose 8 elements from a multiple of 8 of K are not 8
    neighbouring channels (here each channel read twice: one 16-byte copy
    would read the wrong ones), or are but not from a multiple of 8 (the
    copy misaligned), whose index is not a part of the row plus a part of
    K, or whose condition on both is not that the indices lie inside the
    activations, is declined: the chain keeps the kernel.
    (Channels not a multiple of 8 never reach it: implicit_gemm.applies.)"""
    from tvm.script import tirx as T

    from deploy.tvm_compat import tvm

    text = _conv(2, 8, 64, 64, 3, 1).script()
    assert wgmma_gemm.plan(tvm.script.from_source(text, extra_vars={"T": T}), gather=True) is not None
    twice = text.replace("v_k % T.int64(64)]", "v_k % T.int64(64) // T.int64(2)]")
    assert twice != text and wgmma_gemm.plan(tvm.script.from_source(twice, extra_vars={"T": T}), gather=True) is None
    # 8 neighbouring channels from channel 4 of 72: side by side and in bounds, but a 16-byte copy from an
    # 8-byte-aligned address faults (the kernel would end the CUDA context, not fall back)
    shifted = text.replace("T.int64(8), T.int64(64)), \"float16\")", "T.int64(8), T.int64(72)), \"float16\")", 1)
    shifted = shifted.replace("v_k % T.int64(64)]", "v_k % T.int64(64) + T.int64(4)]")
    assert shifted.count("T.int64(72)") == 1 and "+ T.int64(4)]" in shifted
    assert wgmma_gemm.plan(tvm.script.from_source(shifted, extra_vars={"T": T}), gather=True) is None
    # the image index (row + the filter's row) // 64 % 2: side by side, inside and aligned, but not a part of
    # the row plus a part of K, which the kernel computes apart (the row's once a tile, K's once a stage)
    mixed = text.replace("x[v_i // T.int64(64),", "x[(v_i + v_k // T.int64(192)) // T.int64(64) % T.int64(2),")
    assert mixed != text and wgmma_gemm.plan(tvm.script.from_source(mixed, extra_vars={"T": T}), gather=True) is None
    # a condition on the row and K together that is not that the indices lie inside x (here one row short)
    short = text.replace("+ v_i % T.int64(64) // T.int64(8) < T.int64(9)",
                         "+ v_i % T.int64(64) // T.int64(8) < T.int64(8)")
    assert short != text and wgmma_gemm.plan(tvm.script.from_source(short, extra_vars={"T": T}), gather=True) is None


def test_a_gathers_index_is_computed_in_int32_where_it_fits():
    """The producer computes the gather's index and condition for every
    16-byte copy: in int32 (no 64-bit division in the kernel's copies)
    where the activations' elements and each value fit, as for ResNet's
    first 3x3 at batch 64; in the block's int64 where the activations have
    2^32 elements (a strided 1x1 whose GEMM is within int32 all the same)."""
    small = wgmma_gemm.plan(_conv(64, 56, 64, 64, 3, 1), gather=True).gather
    assert small.dtype == "int32" and not any("int64" in t or "T.Cast" in t for t in _texts(small)), small
    src = _compiled(wgmma_gemm.replacement(_conv(64, 56, 64, 64, 3, 1), gather=True)).mod.imports[0].inspect_source()
    producer = src[src.index("if (((int)threadIdx.x) < 128) {"):src.index("cp_async_wait_all_async_wait_all();")]
    assert "int64_t" not in producer and "wg_xf_ptr[" in producer
    huge = wgmma_gemm.plan(_conv(64, 1024, 64, 64, 1, 2), gather=True).gather  # (x: 64 x 1024 x 1024 x 64)
    assert huge.dtype == "int64" and 'T.Cast("int64", wg_arow)' in huge.row_offset, huge


def _texts(g):
    return [g.row_offset, g.k_offset, g.row_cond, g.k_cond, *(t for r, q, _ in g.checks for t in (r, q))]


def _compiled(kernel):
    """`kernel` compiled alone for its own target (sm_90a) by TVM's TIRx pipeline."""
    from deploy.tvm_compat import tvm

    wgmma_gemm.fix_noop_barrier_codegen()
    return tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target=kernel.attrs["target"],
                       tir_pipeline="tirx")


def _gpu_error(func, kernel) -> float:
    """`kernel` (our kernel for `func`) run on the GPU on `func`'s reference
    inputs: its output's relative L2 error against `func` lowered for the
    CPU (tests/emulation.py)."""
    from deploy.tvm_compat import tvm

    args = emulation.reference(func)
    lib = _compiled(kernel)
    dev = tvm.cuda(0)
    got = [tvm.runtime.tensor(a, dev) for a in args[:-1]] + [tvm.runtime.empty(args[-1].shape, args[-1].dtype, dev)]
    lib["main"](*got)
    out, want = got[-1].numpy().astype("float32"), args[-1].astype("float32")
    return float(np.linalg.norm(out - want) / np.linalg.norm(want))


@pytest.mark.parametrize("shape", [(2, 16, 64, 128, 3, 2, True), (1, 16, 64, 64, 3, 1, False),
                                   (24, 7, 64, 64, 3, 1, False), (2, 8, 24, 32, 3, 1, False)],
                         ids=["stride2-residual", "batch-1", "rows-padded", "24-channels"])
def test_the_gather_kernel_compiles_for_sm90a(shape):
    """The gathering producer: 16-byte `cp.async` copies zero-filled by
    their source size, each thread's arrival on the stage's barrier when
    its copies land, and the consumers' proxy fence before `wgmma` reads
    them; nvcc compiles it for sm_90a. (At batch 1 the batch index is a
    constant: the kernel's index types must still agree.)"""
    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    kernel = wgmma_gemm.replacement(_implicit(shape), gather=True)
    src = _compiled(kernel).mod.imports[0].inspect_source()
    for ptx in ("cp.async.cg.shared.global [%0], [%1], 16, %2;", "cp.async.mbarrier.arrive.noinc.shared.b64",
                "fence.proxy.async.shared::cta", "wgmma.mma_async"):
        assert ptx in src
    assert "(uint)129" in src  # (the full barrier: the TMA thread's arrival and 128 gathering threads')
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("shape,pingpong", [((8, 16, 64, 128, 3, 1, False), False),
                                            ((24, 7, 64, 64, 3, 1, False), False),
                                            ((2, 16, 64, 128, 3, 2, True), False),
                                            ((3, 8, 16, 64, 1, 2, False), False),
                                            ((8, 16, 64, 128, 3, 1, False), True),
                                            ((2, 8, 64, 160, 3, 1, False), False),
                                            ((2, 8, 24, 32, 3, 1, False), False)],
                         ids=["3x3-16-tiles", "3x3-rows-padded", "3x3-stride2-residual", "1x1-stride2",
                              "3x3-16-tiles-pingpong", "3x3-160-columns", "3x3-24-channels"])
def test_gpu_an_implicit_gemm_computes_the_convolution(shape, pingpong, monkeypatch):
    """The gathering kernel on the GPU against the function lowered for the
    CPU: a persistent grid of two CTAs (each takes half the tiles: the ring
    of four stages runs on across tiles, 9 K tiles each), pad_gemm's padded
    rows (1,176 rows: the last tile ragged), a stride and a residual, a
    strided 1x1; the 16 tiles with each consumer warpgroup taking whole
    tiles in turn (four each); 160 columns (one tile of 160: the producer's
    registers cut to 40, its rows' parts held in them all the same); 24
    channels (K = 216: the last stage's 3 chunks of 8 in K, the rest zeros)."""

    monkeypatch.setattr(wgmma_gemm, "SMS", 2)
    monkeypatch.setattr(wgmma_gemm, "PINGPONG", pingpong)
    func = _implicit(shape)
    kernel = wgmma_gemm.replacement(func, gather=True)
    assert kernel is not None and wgmma_gemm.plan(func, gather=True).gather is not None
    assert _gpu_error(func, kernel) < 2e-3


def test_the_kernel_builds_for_sm90a_with_the_epilogue_in_it():
    for func, tile, trans in ((_gemm(400, 256, 192, "gelu", pad_to=512), "m64n128k16", "_1_1_0_1("),
                              (_gemm(400, 192, 96, "residual", b_kn=False), "m64n64k16", "_1_1_0_0(")):
        k = wgmma_gemm.kernel(wgmma_gemm.plan(func))
        assert wgmma_gemm.is_ours(k) and str(k.attrs["target"].attrs["arch"]) == "sm_90a"
        src = _compiled(k).mod.imports[0].inspect_source()
        kernel = src[src.index("main_kernel("):]
        assert f"{tile}_f32_f16_f16{trans}" in kernel and "cp_async_bulk_tensor" in kernel
        assert ("erf" in kernel) == ("erf" in wgmma_gemm.plan(func).expr)
        assert "= *(uint4*)(wg_vals_ptr" in kernel or "= *(float4*)(wg_vals_ptr" in kernel  # (16 bytes a store)


def test_a_tile_has_the_columns_that_compute_fewest_past_n():
    """128 or 64 columns where they divide N; else the fewest computed past
    N (the larger on a tie), or N itself with B [N, K] (wgmma's N, any
    multiple of 8 when B is K-major)."""
    tiles = wgmma_gemm.tile_columns
    assert (tiles(384, True), tiles(192, True), tiles(192, False)) == (128, 64, 64)
    assert (tiles(96, True), tiles(288, True), tiles(160, True), tiles(16, True)) == (128, 64, 64, 64)
    assert (tiles(96, False), tiles(240, False), tiles(288, False)) == (96, 240, 64)


# (N = 96 with B [K, N]: one tile of 128 columns, the last 32 past N; with B [N, K]: tiles of 96; N = 288 with
# B [K, N]: five tiles of 64, the last half past N)
_RAGGED_N = [(96, True, "gelu", 128), (96, False, "residual", 96), (288, True, "bias", 64)]


@pytest.mark.parametrize("n,b_kn,epilogue,bn", _RAGGED_N, ids=["96-kn", "96-nk", "288-kn"])
def test_columns_past_n_are_guarded_and_nvcc_compiles_the_kernel(n, b_kn, epilogue, bn):
    """Where the tiles do not divide N the store (and the epilogue's reads
    of per-row and per-column parameters) is kept inside N; where they do,
    the kernel is as it was; nvcc compiles both for sm_90a. (One tile of
    128 columns over N = 96: the compiler drops the last chunk of 32
    columns; each chunk's 16 rows in two passes of a warp, an fp32 item two
    16-byte stores.)"""
    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    func = _gemm(400, n, 192, epilogue, b_kn=b_kn)
    k = wgmma_gemm.kernel(wgmma_gemm.plan(func))
    guard = [line for line in k.script().splitlines() if "< 400" in line]
    assert guard and all((f"< {n})" in line) == (n % bn != 0) for line in guard), guard
    src = _compiled(k).mod.imports[0].inspect_source()
    kernel = src[src.index("main_kernel("):]
    assert f"m64n{bn}k16" in kernel
    stores = 2 * (-(-min(n, bn) // 32)) * (2 if epilogue == "residual" else 1)
    assert len(re.findall(r"= \*\((?:uint4|float4)\*\)\(wg_vals_ptr", kernel)) == stores
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("n,b_kn,epilogue,bn", _RAGGED_N, ids=["96-kn", "96-nk", "288-kn"])
def test_gpu_columns_past_n_read_as_zeros_and_are_not_written(n, b_kn, epilogue, bn, monkeypatch):
    """The kernels of the test above on the GPU, on two persistent CTAs,
    against the function lowered for the CPU: the product over the columns
    that exist (a write past N would land in the next row, where the
    comparison may or may not see it: the test above checks the guard)."""

    monkeypatch.setattr(wgmma_gemm, "SMS", 2)
    func = _gemm(400, n, 192, epilogue, b_kn=b_kn)
    assert _gpu_error(func, wgmma_gemm.replacement(func)) < 2e-3


# N and K multiples of 8, not 16: a classifier's 1,000 columns; 24 and 40 channels (B [N, K]: a tile of 24
# columns; K within one stage)
_EIGHTS = [(1000, 192, True, "bias"), (24, 40, False, "residual"), (40, 24, True, "gelu")]


@pytest.mark.parametrize("n,k,b_kn,epilogue", _EIGHTS, ids=["n1000", "n24-k40", "n40-k24"])
def test_n_and_k_multiples_of_8_are_planned_and_nvcc_compiles_the_kernel(n, k, b_kn, epilogue):
    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    p = wgmma_gemm.plan(_gemm(400, n, k, epilogue, b_kn=b_kn))
    assert p is not None and (p.n, p.k) == (n, k)
    src = _compiled(wgmma_gemm.kernel(p)).mod.imports[0].inspect_source()
    assert f"m64n{wgmma_gemm.tile_columns(n, b_kn)}k16" in src
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,b_kn,epilogue", _EIGHTS, ids=["n1000", "n24-k40", "n40-k24"])
def test_gpu_n_and_k_multiples_of_8_compute_what_the_cpu_computes(n, k, b_kn, epilogue, monkeypatch):
    """The kernels above on two persistent CTAs against the function lowered
    for the CPU (K past its end and N past its end read as zeros)."""

    monkeypatch.setattr(wgmma_gemm, "SMS", 2)
    func = _gemm(400, n, k, epilogue, b_kn=b_kn)
    assert _gpu_error(func, wgmma_gemm.replacement(func)) < 2e-3


def test_what_it_leaves_to_the_schedule_chain():
    """Declined, never raised: N or K not a multiple of 8, producers other than
    row padding or an implicit GEMM's gather (even with gathers on: an
    element-wise producer, a gather of a 3-D input, a column mask), an
    epilogue whose intermediate is an output too, an fp32 GEMM."""
    from tvm import te, tirx

    assert wgmma_gemm.plan(_gemm(112, 100, 48, "bias")) is None and wgmma_gemm.plan(_gemm(112, 96, 36, "bias")) is None
    a = te.placeholder((64, 32), "float16", name="a")
    w = te.placeholder((32, 64), "float16", name="w")
    r = te.reduce_axis((0, 32), "r")

    def gemm_of(src):
        return te.compute((64, 64), lambda i, j: te.sum(src[i, r].astype("float32") * w[r, j].astype("float32"),
                                                        axis=r), name="c")

    sq = te.compute((64, 32), lambda i, j: a[i, j] * a[i, j], name="sq")
    assert wgmma_gemm.replacement(te.create_prim_func([a, w, gemm_of(sq)]), gather=True) is None
    x3 = te.placeholder((8, 8, 32), "float16", name="x3")
    rows = te.compute((64, 32), lambda i, j: tirx.if_then_else(i < 48, x3[i // 8, i % 8, j],
                                                               tirx.const(0, "float16")), name="x_rows")
    assert wgmma_gemm.replacement(te.create_prim_func([x3, w, gemm_of(rows)]), gather=True) is None
    cols = te.compute((64, 32), lambda i, j: tirx.if_then_else(j < 24, a[i, j], tirx.const(0, "float16")),
                      name="a_cols")
    assert wgmma_gemm.replacement(te.create_prim_func([a, w, gemm_of(cols)]), gather=True) is None
    bias = te.placeholder((64,), "float16", name="bias")
    c = gemm_of(a)
    h = te.compute((64, 64), lambda i, j: c[i, j].astype("float16") + bias[j], name="h")
    g = te.compute((64, 64), lambda i, j: h[i, j] * h[i, j], name="g")
    assert wgmma_gemm.replacement(te.create_prim_func([a, w, bias, h, g])) is None
    a32 = te.placeholder((64, 32), "float32", name="a")
    w32 = te.placeholder((32, 64), "float32", name="w")
    c32 = te.compute((64, 64), lambda i, j: te.sum(a32[i, r] * w32[r, j], axis=r))
    assert wgmma_gemm.replacement(te.create_prim_func([a32, w32, c32])) is None


def _module(m=400, k=192):
    """A Relax module: h = the gelu-epilogue GEMM of x, y = the residual
    GEMM of h, then y * 2 (an element-wise kernel the schedule chain takes)."""
    from tvm import te

    from deploy.tvm_compat import relax

    f1 = _gemm(m, 256, k, "gelu").with_attr("global_symbol", "gemm_gelu")
    f2 = _gemm(m, 128, 256, "residual").with_attr("global_symbol", "gemm_residual")
    yin = te.placeholder((m, 128), "float32", name="yin")
    f3 = te.create_prim_func([yin, te.compute((m, 128), lambda i, j: yin[i, j] * 2.0, name="twice")]
                             ).with_attr("global_symbol", "twice")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, k], "float16"))
    w1 = relax.Var("w1", relax.TensorType([k, 256], "float16"))
    b1 = relax.Var("b1", relax.TensorType([256], "float16"))
    w2 = relax.Var("w2", relax.TensorType([256, 128], "float16"))
    b2 = relax.Var("b2", relax.TensorType([128], "float16"))
    res = relax.Var("res", relax.TensorType([m, 128], "float32"))
    with bb.function("main", [x, w1, b1, w2, b2, res]):
        with bb.dataflow():
            g1, g2, g3 = bb.add_func(f1, "gemm_gelu"), bb.add_func(f2, "gemm_residual"), bb.add_func(f3, "twice")
            h = bb.emit(relax.call_tir(g1, [x, w1, b1], relax.TensorType([m, 256], "float16")))
            y = bb.emit(relax.call_tir(g2, [h, w2, b2, res], relax.TensorType([m, 128], "float32")))
            z = bb.emit_output(relax.call_tir(g3, [y], relax.TensorType([m, 128], "float32")))
        bb.emit_func_output(z)
    return bb.get()


def _profile(**cuda):
    """CUDA's profile, in fp16 unless `cuda` says otherwise."""
    from deploy import config

    return config.from_dict({"model": {"source": "resnet50"}, "cuda": {"precision": "fp16", **cuda}}).profile("cuda")


def _build(mod, target_name, wgmma=True):
    from deploy import build, targets
    from deploy.passes import schedule

    target = targets.resolve(target_name)
    profile = _profile(wgmma_gemm=wgmma)
    with target.tvm_target():
        return schedule.build(mod, None, target.tvm_target(), "cuda",
                              compile_fn=lambda m: build.compile_module(m, target, profile),
                              kernel_builds=lambda name, f: build.build_kernel(name, f, target), wgmma=wgmma)


def _cuda_sources(module) -> list[str]:
    out = []
    for i in module.imports:
        try:
            text = i.inspect_source()
            if "__global__" in text:
                out.append(text)
        except Exception:  # noqa: BLE001 - (a module without source)
            pass
        out += _cuda_sources(i)
    return out


def test_a_module_builds_with_the_kernels_through_our_pipeline():
    """Both GEMMs take the kernel (schedule source `wgmma-gemm`), the
    element-wise kernel its chain, and the module compiles for sm_90 into
    two CUDA modules: TIRx's with the wgmma kernels, ours with the other."""
    from deploy.passes import schedule

    compiled, kernels = _build(_module(), "cuda:sm_90")
    sources = schedule.summarize(kernels)["sources"]
    assert sources.get(wgmma_gemm.RULE) == 2 and sum(sources.values()) == 3
    cuda = _cuda_sources(compiled.mod)
    assert len(cuda) == 2 and sorted("wgmma.mma_async" in s for s in cuda) == [False, True]


def test_off_it_changes_nothing_and_elsewhere_it_is_not_offered():
    from deploy.passes import schedule

    _, kernels = _build(_module(), "cuda:sm_90", wgmma=False)
    assert wgmma_gemm.RULE not in schedule.summarize(kernels)["sources"]
    _, kernels = _build(_module(), "cuda:sm_80")
    assert wgmma_gemm.RULE not in schedule.summarize(kernels)["sources"]


def test_a_kernel_not_made_falls_back_with_its_reason(monkeypatch):
    """Where the kernel is not made from a plan (say, a TVMScript change
    breaks the template), the chain takes the GEMM and the build's fallbacks
    say why."""
    from deploy.passes import schedule

    def broken(*args, **kwargs):
        raise ValueError("the template does not parse")

    monkeypatch.setattr(wgmma_gemm, "kernel", broken)
    _, kernels = _build(_module(), "cuda:sm_90")
    report = schedule.summarize(kernels)
    assert wgmma_gemm.RULE not in report["sources"]
    assert len(report["fallbacks"]) == 2
    assert all(f["from"] == [wgmma_gemm.RULE] and "the template does not parse" in f["reasons"][0]
               for f in report["fallbacks"])


def test_a_module_with_the_kernels_compiles_for_sm90a():
    from deploy import targets
    from deploy.tvm_compat import tvm

    sm90 = targets.resolve("cuda:sm_90").tvm_target()
    func = wgmma_gemm.replacement(_gemm(400, 256, 192, "bias"))
    with_ours = tvm.IRModule({"k": func})
    assert str(wgmma_gemm.compile_target(sm90, with_ours).attrs["arch"]) == "sm_90a"
    assert wgmma_gemm.compile_target(sm90, tvm.IRModule({"k": _gemm(64, 64, 64, "bias")})).same_as(sm90)
    sm80 = targets.resolve("cuda:sm_80").tvm_target()
    assert wgmma_gemm.compile_target(sm80, with_ours).same_as(sm80)


def test_tvm_still_compiles_cuda_for_the_current_target_not_the_modules():
    """The workaround in compile_target: TVM's CUDA compile callback takes
    no target and compiles for Target.current()'s arch, and sm_90's ptxas
    refuses wgmma (nvcc on the CPU machine, as NVRTC on the GPU machine).
    Fails once the callback takes the module's target."""
    import inspect

    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    assert "def tvm_callback_cuda_compile(code):" in inspect.getsource(nvcc)  # (registered: an ffi.Function)
    src = _compiled(wgmma_gemm.replacement(_gemm(128, 64, 64, "bias"))).mod.imports[0].inspect_source()
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):  # (what compile_target gives)
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), pytest.raises(Exception, match="wgmma"):
        nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


def test_the_flag_is_refused_on_the_cpu_and_outside_fp16():
    from deploy import config
    from deploy.errors import ConfigError

    assert config.from_dict({"model": {"source": "vit"}, "cuda": {"precision": "fp16", "wgmma_gemm": True}}
                            ).profile("cuda").wgmma_gemm
    with pytest.raises(ConfigError, match="wgmma_gemm"):
        config.from_dict({"model": {"source": "vit"}, "cuda": {"precision": "fp32", "wgmma_gemm": True}})
    with pytest.raises(ConfigError, match="wgmma_gemm"):
        config.from_dict({"model": {"source": "vit"}, "llvm": {"wgmma_gemm": True}})


def test_a_consumer_can_leave_one_group_in_flight():
    """in_flight=1: each consumer waits for all but the group it just issued
    and then gives the stage before back, and for the last one before the
    epilogue reads the accumulators; nvcc compiles it. 0 is the kernel as
    it was; 2 is refused."""
    import re

    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    plan = wgmma_gemm.plan(_gemm(400, 256, 320, "gelu"))
    src = {f: _compiled(wgmma_gemm.kernel(plan, in_flight=f)).mod.imports[0].inspect_source() for f in (0, 1)}
    waits = {f: re.findall(r"wait_group_sync_aligned_(\d)\(\)", s[s.index("main_kernel("):]) for f, s in src.items()}
    assert waits == {0: ["0"], 1: ["1", "0"]}
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert nvcc.compile_cuda(src[1], target_format="cubin", compiler="nvcc")
    with pytest.raises(ValueError, match="in flight"):
        wgmma_gemm.kernel(plan, in_flight=2)


def test_pingpong_gives_each_consumer_whole_tiles_in_turn():
    """pingpong: each consumer warpgroup issues both 64-row halves' wgmma
    (the second 512 16-byte units further into the A stage), waits for its
    turn (an mbarrier of 128 arrivals, the other warpgroup's) before a
    tile's products, and stores both halves; nvcc compiles it, for a gather
    too. More than 128 columns are refused (256 accumulators a thread)."""
    from tvm.support import nvcc

    from deploy.tvm_compat import tvm

    plan = wgmma_gemm.plan(_gemm(400, 256, 320, "gelu"))
    one, two = (wgmma_gemm.kernel(plan, pingpong=pp) for pp in (False, True))
    assert two.script().count("m64n128k16") == 2 * one.script().count("m64n128k16") == 2
    assert "wg_d_a + T.uint64(512)" in two.script() and "wg_turn" not in one.script().split("T.cuda.cta_sync")[1]
    for k in (two, wgmma_gemm.kernel(wgmma_gemm.plan(_implicit((8, 16, 64, 128, 3, 1, False)), gather=True),
                                     pingpong=True)):
        src = _compiled(k).mod.imports[0].inspect_source()
        kernel = src[src.index("main_kernel("):]
        # (`empty` counts one warpgroup's arrivals, as the two `turn` barriers do; each warpgroup waits on one)
        assert kernel.count("(uint)128)") == wgmma_gemm.STAGES + 2 and "(uint)256)" not in kernel
        assert "wg_turn_ptr[" in kernel[kernel.index("mbarrier_wait"):]
        with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
            assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")
    stores = {}
    for pp, k in ((False, one), (True, two)):
        src = _compiled(k).mod.imports[0].inspect_source()
        stores[pp] = src[src.index("main_kernel("):].count("= *(uint4*)(wg_vals_ptr")
    assert stores[True] == 2 * stores[False] == 16  # (both halves' stores: 4 chunks of 32 columns, 2 passes, 2 halves)
    with pytest.raises(ValueError, match="pingpong"):
        wgmma_gemm.kernel(plan, pingpong=True, bn=256)
    ragged = wgmma_gemm.plan(_gemm(400, 240, 64, "bias", b_kn=False))  # (B [N, K]: a tile of N = 240 unless pingpong)
    assert "m64n240k16" in wgmma_gemm.kernel(ragged).script()
    assert "m64n128k16" in wgmma_gemm.kernel(ragged, pingpong=True).script()


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight,pingpong,sms", [(0, False, 2), (1, False, 2), (0, True, 2), (1, True, 3)])
def test_gpu_the_kernels_compute_what_numpy_computes(in_flight, pingpong, sms, monkeypatch):
    """The module above on the GPU: 400 rows (the last tile ragged), K = 320
    (five K tiles through a four-stage ring), the GELU and residual
    epilogues, and a persistent grid of two CTAs, so that each takes four
    of the eight tiles (the ring and the accumulators carried across tiles);
    with one wgmma group left in flight, and each consumer warpgroup taking
    whole tiles in turn (two each a CTA; on three CTAs, 3, 3 and 2 tiles:
    the first warpgroup takes one more than the second), too."""
    from deploy.passes import schedule
    from deploy.tvm_compat import relax, tvm

    monkeypatch.setattr(wgmma_gemm, "SMS", sms)
    monkeypatch.setattr(wgmma_gemm, "IN_FLIGHT", in_flight)
    monkeypatch.setattr(wgmma_gemm, "PINGPONG", pingpong)
    mod = _module(m=400, k=320)
    compiled, kernels = _build(mod, "cuda")
    assert schedule.summarize(kernels)["sources"].get(wgmma_gemm.RULE) == 2  # (compiled as ours, no fallback)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((400, 320)) / 4).astype("float16")
    w1 = (rng.standard_normal((320, 256)) / 16).astype("float16")
    b1 = (rng.standard_normal(256) / 4).astype("float16")
    w2 = (rng.standard_normal((256, 128)) / 16).astype("float16")
    b2 = (rng.standard_normal(128) / 4).astype("float16")
    res = rng.standard_normal((400, 128)).astype("float32")
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(compiled, dev)
    got = vm["main"](*[tvm.runtime.tensor(a, dev) for a in (x, w1, b1, w2, b2, res)]).numpy()
    from math import erf

    verf = np.vectorize(erf)
    h = (x.astype("float32") @ w1.astype("float32")).astype("float16") + b1
    h = (h * (verf((h / np.float16(1.4142135623730951)).astype("float32")).astype("float16") + np.float16(1))
         * np.float16(0.5)).astype("float16")
    want = 2.0 * (res + ((h.astype("float32") @ w2.astype("float32")).astype("float16") + b2).astype("float32"))
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 2e-3


def test_by_default_on_in_fp16_on_cuda_only():
    """CUDA's profile takes the kernel by default in fp16 (on sm_90, where
    the pass offers it); not in fp32 or TF32, not on the CPU, and not where
    the user turns it off."""
    from deploy import config

    assert _profile().uses_wgmma_gemm and not _profile(wgmma_gemm=False).uses_wgmma_gemm
    assert not _profile(precision="fp32").uses_wgmma_gemm
    assert not _profile(precision="tf32", layout="NHWC").uses_wgmma_gemm
    assert not config.from_dict({"model": {"source": "vit"}}).profile("llvm").uses_wgmma_gemm


def test_tuning_leaves_out_the_gemms_the_kernel_takes(tmp_path):
    """The GEMMs the build gives our kernel before any tuning record are not
    tuned (their records would go unused): the tuner's tasks of the module
    above on sm_90 are the element-wise kernel's alone, with the flag on;
    all three with it off, or on sm_80."""
    from deploy import targets
    from deploy.tuning import tasks as tune_tasks
    from deploy.tuning import tune

    sm90, sm80 = (targets.resolve(t) for t in ("cuda:sm_90", "cuda:sm_80"))
    found = tune_tasks.extract_tasks(_module(), sm90.tvm_target())
    assert sorted(tune_tasks.wgmma_tasks(found, sm90.tvm_target())) == ["gemm_gelu", "gemm_residual"]
    assert tune_tasks.wgmma_tasks(found, sm80.tvm_target()) == []

    def tuned(target, **cuda):
        summary = tune.tune_bucket(_module(), tmp_path / f"db-{target.arch}-{len(cuda)}", {"k": 1}, target,
                                   _profile(trials=0, **cuda),
                                   deadline=None, work=tmp_path)
        return summary["tasks_total"], summary.get("tasks_wgmma", 0)

    assert tuned(sm90) == (1, 2)
    assert tuned(sm90, wgmma_gemm=False) == (3, 0)
    assert tuned(sm80) == (3, 0)


def test_implicit_gemms_are_the_kernels_where_gathers_are_asked_for():
    """The kernel takes implicit GEMMs, whose A it gathers, where `gather`
    is asked for (the build and tuning ask wherever the kernel is in use:
    by default, fp16 on sm_90): neither the plan nor tuning's list of the
    tasks it takes has them otherwise."""
    from deploy import targets
    from deploy.tuning import tasks as tune_tasks
    from deploy.tvm_compat import relax

    conv = _conv(2, 8, 64, 64, 3, 1)
    assert wgmma_gemm.plan(conv, gather=False) is None and wgmma_gemm.plan(conv, gather=True).gather is not None
    assert wgmma_gemm.replacement(conv) is None
    bb = relax.BlockBuilder()  # (a Relax module calling it: MetaSchedule's tasks come from one)
    args = [relax.Var(str(a), relax.TensorType([int(d) for d in a.shape], str(a.dtype))) for a in conv.params[:-1]]
    out = conv.params[-1]
    with bb.function("main", args):
        with bb.dataflow():
            y = bb.emit_output(relax.call_tir(bb.add_func(conv, "conv"), args,
                                              relax.TensorType([int(d) for d in out.shape], str(out.dtype))))
        bb.emit_func_output(y)
    sm90 = targets.resolve("cuda:sm_90").tvm_target()
    found = tune_tasks.extract_tasks(bb.get(), sm90)
    assert len(found) == 1
    assert tune_tasks.wgmma_tasks(found, sm90, gather=False) == []
    assert tune_tasks.wgmma_tasks(found, sm90, gather=True) == [found[0].task_name]


def test_the_untuned_builds_cache_key_names_what_the_kernel_takes():
    """A cached untuned build is reused only for the same kernels: the key
    names the kernel where it can act (sm_90 fp16) and its implicit GEMMs
    (wherever it acts: a build cached before it took them is not reused),
    and nothing on other archs."""
    import types

    from deploy import pipeline, targets

    opt = types.SimpleNamespace(manifest={"files": {}, "buckets": {}})

    def key(target, **cuda):
        k = pipeline.untuned_key(opt, targets.resolve(target), _profile(**cuda), [])
        return k.get("wgmma_gemm", False), k.get("wgmma_gather", False)

    assert key("cuda:sm_90") == (True, True)
    assert key("cuda:sm_90", wgmma_gemm=True) == (True, True)
    assert key("cuda:sm_90", wgmma_gemm=False) == (False, False)
    assert key("cuda:sm_80") == (False, False)
