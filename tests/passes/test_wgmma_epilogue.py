"""deploy/passes/wgmma_epilogue.py: the wgmma kernel's epilogue through
shared memory. Which of the epilogue's loads become 16-byte loads, where
they are issued, and that the kernel stores 16 bytes a thread and nvcc
compiles it without spilling; the results against PyTorch are the GPU
tests' (test_wgmma_gemm.py, test_wgmma_probe.py)."""

from __future__ import annotations

import re
import subprocess

import pytest

from deploy.passes import wgmma_epilogue, wgmma_gemm

from .test_wgmma_gemm import _compiled, _conv, _gemm

_PARAMS = [("a", [400, 64], "float16"), ("w", [64, 128], "float16"), ("bias", [128], "float16"),
           ("b2", [1, 128], "float16"), ("res", [400, 128], "float32"), ("t", [128, 400], "float16"),
           ("wide", [400, 256], "float16"), ("i", [400, 128], "int32"), ("out", [400, 128], "float16")]


def test_the_loads_of_a_row_or_a_column_become_vector_loads():
    """[wg_row, wg_colc] and [wg_colc] (leading zeros allowed) of an fp16 or
    fp32 parameter N wide; not a transposed read, another width, an int
    parameter, or an index that is not the thread's row and column."""
    expr = ("res[wg_row, wg_colc] + T.Cast('float32', bias[wg_colc] + b2[T.int64(0), wg_colc] + t[wg_colc, wg_row]"
            " + wide[wg_row, wg_colc] + T.Cast('float16', i[wg_row, wg_colc]) + res[wg_row, wg_colc + 1])"
            " + res[wg_row, wg_colc]")
    loads = wgmma_epilogue.vector_loads(expr, _PARAMS, 128)
    assert [(ld.name, ld.rows, ld.local) for ld in loads] == [("res", True, "wg_v0"), ("bias", False, "wg_v1"),
                                                             ("b2", False, "wg_v2")]


def _source(func, **kw):
    k = wgmma_gemm.kernel(wgmma_gemm.plan(func, gather=True), **kw)
    src = _compiled(k).mod.imports[0].inspect_source()
    return k, src[src.index("main_kernel("):]


@pytest.mark.parametrize("case", ["fp16-residual", "fp32-residual", "pingpong"])
def test_a_residuals_loads_come_before_the_products_where_they_fit(case):
    """ResNet's 1x1 GEMM (an fp16 residual, 128 columns: 8 x 16 bytes a
    thread) has the residual's loads issued before the tile's first wgmma;
    an fp32 residual (twice the bytes) and pingpong (twice the rows) load
    it at each chunk, after the products. The bias is loaded at each chunk
    either way; every load and store is 16 bytes."""
    if case == "fp16-residual":
        func, kw = _conv(2, 16, 64, 256, 1, 2, residual=True), {}
    else:
        func, kw = _gemm(400, 128, 64, "residual"), ({"pingpong": True} if case == "pingpong" else {})
        if case == "pingpong":
            func = _conv(2, 16, 64, 128, 1, 2, residual=True)
    _, kernel = _source(func, **kw)
    residual = [m.start() for m in re.finditer(r"= \*\((?:uint4|float4)\*\)\((?:lv|res)\w*_ptr", kernel)]
    first_mma = kernel.index("mma_async_sync_aligned_m64n")
    assert residual
    assert all(at < first_mma for at in residual[:8]) is (case == "fp16-residual")
    assert not re.search(r"\*\((?:half2|float2)\*\)\([^)]*(?:compute|out)\w*_ptr", kernel)  # (no 4-byte stores)


def test_the_staged_kernel_compiles_without_spilling(tmp_path):
    """nvcc compiles the staged kernel (a gather's with an fp16 residual,
    256 columns with a bias) for sm_90a with no local memory; its shared
    memory is the ring's (dynamic) and the warps' staging, 8 x 16 rows of 40
    floats (static) with the barriers."""
    for i, (func, kw) in enumerate(((_conv(2, 16, 64, 128, 3, 1, residual=True), {}),
                                    (_gemm(400, 512, 64, "bias", b_kn=False), {"bn": 256}))):
        k, _ = _source(func, **kw)
        src = _compiled(k).mod.imports[0].inspect_source()
        (tmp_path / f"k{i}.cu").write_text(src)
        r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "--resource-usage", "-o", str(tmp_path / f"k{i}.cubin"),
                            str(tmp_path / f"k{i}.cu")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        usage = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
                          r"Used \d+ registers.*?(\d+) bytes smem", r.stdout + r.stderr, re.S)
        assert usage and usage.groups() == ("0", "0", "0", str(8 * 16 * 40 * 4 + 1024)), r.stdout + r.stderr


def test_the_first_epilogue_is_still_there_and_an_unknown_one_refused():
    plan = wgmma_gemm.plan(_gemm(400, 128, 64, "bias"))
    assert "wg_stage" not in wgmma_gemm.kernel(plan, epilogue="registers").script()
    assert "wg_stage" in wgmma_gemm.kernel(plan).script()
    with pytest.raises(ValueError, match="unknown epilogue"):
        wgmma_gemm.kernel(plan, epilogue="tma")


def test_several_per_column_loads_and_names_ending_in_anothers():
    """An epilogue reading three per-column parameters, [N] and [1, N], one
    named as another's suffix (`b`, `lv_b`), and a residual: each its own
    vector load, the kernel parses, lowers and compiles."""
    from tvm import te

    m, n, k = 256, 128, 64
    a = te.placeholder((m, k), "float16", name="a")
    w = te.placeholder((k, n), "float16", name="w")
    b = te.placeholder((n,), "float16", name="b")
    lv_b = te.placeholder((n,), "float16", name="lv_b")
    scale = te.placeholder((1, n), "float16", name="scale")
    res = te.placeholder((m, n), "float16", name="res")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * w[r, j].astype("float32"), axis=r),
                   name="c")
    out = te.compute((m, n), lambda i, j: (c[i, j].astype("float16") + b[j] + lv_b[j]) * scale[0, j] + res[i, j],
                     name="out")
    p = wgmma_gemm.plan(te.create_prim_func([a, w, b, lv_b, scale, res, out]))
    assert p is not None
    loads = wgmma_epilogue.vector_loads(p.expr, p.params, n)
    assert sorted(ld.name for ld in loads) == ["b", "lv_b", "res", "scale"]
    _, kernel = _source(te.create_prim_func([a, w, b, lv_b, scale, res, out]))
    assert kernel.count("= *(uint4*)(") >= 4 + 2  # (the four loads, at least; the stores)


def test_a_chunk_of_blocks_other_than_1_2_4_or_8_is_refused(monkeypatch):
    monkeypatch.setattr(wgmma_epilogue, "CHUNK_BLOCKS", 3)
    with pytest.raises(ValueError, match="CHUNK_BLOCKS"):
        wgmma_gemm.kernel(wgmma_gemm.plan(_gemm(400, 96, 64, "bias")))


def test_two_residuals_are_loaded_in_one_pass_before_the_products():
    """Two [rows, N] parameters (64 columns: 64 bytes of each a thread, so
    both prefetched): one loop over the thread's rows loads both, before
    the first wgmma; the kernel parses, lowers and compiles."""
    from tvm import te

    m, n, k = 256, 64, 64
    a = te.placeholder((m, k), "float16", name="a")
    w = te.placeholder((k, n), "float16", name="w")
    r1 = te.placeholder((m, n), "float16", name="r1")
    r2 = te.placeholder((m, n), "float16", name="r2")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * w[r, j].astype("float32"), axis=r),
                   name="c")
    out = te.compute((m, n), lambda i, j: c[i, j].astype("float16") + r1[i, j] * r2[i, j], name="out")
    func = te.create_prim_func([a, w, r1, r2, out])
    text = wgmma_gemm.kernel(wgmma_gemm.plan(func)).script()
    assert text.count("for wg_p in T.unroll(2)") == 2  # (the prefetch's rows, once for both; the epilogue's)
    _, kernel = _source(func)
    loads = [m.start() for m in re.finditer(r"= \*\(uint4\*\)\(r[12]_ptr", kernel)]
    assert len(loads) == 2 * 2 * 2 and max(loads) < kernel.index("mma_async_sync_aligned_m64n")
