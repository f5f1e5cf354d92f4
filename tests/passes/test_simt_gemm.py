"""deploy/passes/simt_gemm.py: fp32 GEMMs and convolutions in 128 x 128
tiles on the CUDA cores, on the CPU machine (emulated: tests/emulation.py;
compiled by nvcc) and, with `-m gpu`, on a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploy import targets
from deploy.passes import schedule, simt_gemm
from deploy.passes.simt_gemm import SimtGemm
from deploy.tvm_compat import tvm

from .. import cuda_emu, emulation
from .test_attention import _nvcc_usage
from .test_gpu_default import _first_source
from .test_mma_gemm import _i64


def _conv(n=2, size=8, c=32, o=64, k=3, stride=1, pad=1, dtype="float32", relu=True):
    """An NHWC convolution with OHWI weights, its padding, a bias and a ReLU,
    as the frontend gives a ResNet's."""
    from tvm import te, topi

    x = te.placeholder((_i64(n), _i64(size), _i64(size), _i64(c)), dtype, name="x")
    w = te.placeholder((_i64(o), _i64(k), _i64(k), _i64(c)), dtype, name="w")
    b = te.placeholder((_i64(o),), dtype, name="b")
    xp = topi.nn.pad(x, [0, pad, pad, 0], [0, pad, pad, 0], name="pad_temp")
    out = (size + 2 * pad - k) // stride + 1
    ry, rx, rc = (te.reduce_axis((_i64(0), _i64(e)), name) for e, name in ((k, "ry"), (k, "rx"), (c, "rc")))
    y = te.compute((_i64(n), _i64(out), _i64(out), _i64(o)),
                   lambda a, i, j, f: te.sum(xp[a, i * stride + ry, j * stride + rx, rc] * w[f, ry, rx, rc],
                                             axis=[ry, rx, rc]), name="conv2d_nhwc")
    z = te.compute(y.shape, lambda a, i, j, f: y[a, i, j, f] + b[f], name="bias")
    if relu:
        z = te.compute(y.shape, lambda *i: te.max(z(*i), tvm.tirx.const(0, dtype)), name="relu")
    return te.create_prim_func([x, w, b, z])


def _matmul(m, n, k, dtype="float32", batch=None, body=None):
    """A dense layer with its weight [K, N] (B's rows, in the GEMM's terms,
    contiguous: copied along them); `batch` of them with their own A
    and B (an fp32 attention's batched matmul); `body(a, b)` in place of the
    product."""
    from tvm import te

    lead = (_i64(batch),) if batch else ()
    a = te.placeholder((*lead, _i64(m), _i64(k)), dtype, name="A")
    b = te.placeholder((*lead, _i64(k), _i64(n)), dtype, name="B")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")
    body = body or (lambda x, y: x * y)
    c = te.compute((*lead, _i64(m), _i64(n)),
                   lambda *ij: te.sum(body(a[(*ij[:-2], ij[-2], r)], b[(*ij[:-2], r, ij[-1])]), axis=r), name="C")
    return te.create_prim_func([a, b, c])


# (what, the kernel, the tile it takes); each over 16,384 outputs (fewer are FewOutputs')
CASES = [
    ("a 3x3 convolution, padded, stride 1", lambda: _conv(size=16), (128, 64)),
    ("stride 2", lambda: _conv(size=32, stride=2), (128, 64)),
    ("a 7x7 stem over 3 channels: K = 147, padded to 160", lambda: _conv(size=32, c=3, k=7, stride=2, pad=3),
     (128, 64)),
    ("a 1x1 convolution, no epilogue but the bias", lambda: _conv(size=16, c=64, o=128, k=1, pad=0, relu=False),
     (128, 128)),
    ("a matmul whose rows and columns no tile divides", lambda: _matmul(200, 136, 40), (128, 64)),  # (136 -> 192)
    ("3 batched matmuls, each its own A and B", lambda: _matmul(128, 64, 24, batch=3), (128, 64)),
]


@pytest.mark.parametrize("what, make, tile", CASES, ids=[c[0] for c in CASES])
def test_an_fp32_gemm_gets_the_tiled_schedule_and_computes_what_tvms_plain_lowering_does(
        sm90, monkeypatch, what, make, tile):
    """Bit for bit: a thread sums each output's K steps in order, as the
    plain lowering does (the padded steps add zeros)."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)  # (small kernels: the emulator runs each thread in Python)
    func = make()
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SIMT_GEMM, what
    grid, block, _ = emulation.launch(scheduled, sm90)
    assert block == (simt_gemm.THREADS_X, simt_gemm.THREADS_Y), what
    src = emulation.source(scheduled, sm90)
    local = re.search(r"float \w+_local_ptr\[(\d+)\];", src)
    assert local and int(local.group(1)) == tile[0] * tile[1] // 256, (what, src[:3000])  # a thread's sums
    assert f"float {_shared_name(src)}[{simt_gemm.K_TILE * (tile[0] + simt_gemm.PAD)}]" in src, what  # [k][row + 4]
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, (what, problems, np.abs(got - args[-1]).max())


def _conv_nchw_1x1(n=2, size=16, c=32, o=64, stride=2):
    """An NCHW 1x1 convolution at stride 2 (a ResNet's downsampling
    shortcut, NCHW): in the GEMM's terms its A's rows are innermost in
    memory, but 2 floats apart."""
    from tvm import te

    x = te.placeholder((_i64(n), _i64(c), _i64(size), _i64(size)), "float32", name="x")
    w = te.placeholder((_i64(o), _i64(c)), "float32", name="w")
    rc = te.reduce_axis((_i64(0), _i64(c)), "rc")
    out = (size - 1) // stride + 1
    y = te.compute((_i64(n), _i64(o), _i64(out), _i64(out)),
                   lambda a, f, i, j: te.sum(x[a, rc, i * stride, j * stride] * w[f, rc], axis=rc), name="conv")
    return te.create_prim_func([x, w, y])


PIPELINED = [CASES[0], CASES[4],
             ("an NCHW 1x1 convolution at stride 2: copied along K, not its strided rows", _conv_nchw_1x1, (128, 64))]


@pytest.mark.parametrize("what, make, tile", PIPELINED, ids=[c[0] for c in PIPELINED])
def test_two_stages_copy_the_next_k_tile_by_cp_async_while_this_one_is_summed(sm90, monkeypatch, what, make, tile):
    """STAGES=2: TVM's software pipeline over the K tiles, its copies
    asynchronous (our TIR pipeline turns cp.async on for simt_gemm's marked
    loop as for tensor-core kernels: passes/tensor_core_smem.py); the same sums, in the
    same order, and no copy in flight read or overwritten (the emulation
    checks both)."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    monkeypatch.setattr(simt_gemm, "STAGES", 2)
    func = make()
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SIMT_GEMM, what
    src = emulation.source(scheduled, sm90)
    assert "cp.async.ca.shared.global" in src and "cp.async.wait_group 1;" in src, (what, src[:3000])
    staged = re.findall(r"__shared__ alignas\(64\) float \w+\[(\d+)\];", src)  # (A's and B's, two tiles each)
    assert sorted(map(int, staged)) == sorted(2 * simt_gemm.K_TILE * (t + simt_gemm.PAD) for t in tile), (what, staged)
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, (what, problems, np.abs(got - args[-1]).max())


@pytest.mark.parametrize("stages, copy", [(1, "*(float4*)(B_ptr + "), (2, "ptx_cp_async_legacy_pred_cg_16_4_4(B_")])
def test_a_k_by_n_weight_is_copied_16_bytes_at_a_time_as_it_is_stored(sm90, monkeypatch, stages, copy):
    """A dense layer's [K, N] weight (a transformer's, attention's V) has its
    rows, not K, contiguous: its copy runs along the rows, 16 bytes from
    global memory to 16 in the step-major tile (a cp.async of 16 bytes with
    two stages), where a copy along K would read 4 floats N apart. Emulated
    above (CASES' matmuls)."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    monkeypatch.setattr(simt_gemm, "STAGES", stages)
    src = emulation.source(SimtGemm().apply(_matmul(200, 136, 40), sm90).mod["main"], sm90)
    assert copy in src, src[:4000]


def test_the_emulation_sees_a_misaligned_16_byte_store(sm90, monkeypatch):
    """What makes the 16-byte accesses above mean something: a GPU faults
    on a float4 at an address not a multiple of 16 (TVM emits one only where
    it proves the address a multiple of 4 floats; a copy along a row that
    is not contiguous would break that); the emulation reports it."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    func = _matmul(200, 136, 40)
    scheduled = SimtGemm().apply(func, sm90).mod["main"]
    src = emulation.source(scheduled, sm90)
    assert "*(float4*)(C_ptr + (" in src
    args = emulation.reference(func)
    _, problems = emulation.run(func, scheduled, sm90, args, src)
    assert not problems
    # (each output a float further on, C a float longer: in range, every store misaligned)
    tensors = {b.name: np.ascontiguousarray(a).view(np.uint8).ravel().copy() for b, a in zip(func.params, args)}
    tensors["C"] = np.zeros(tensors["C"].size + 4, np.uint8)
    grid, block, dyn = emulation.launch(scheduled, sm90)
    problems, _ = cuda_emu.run(src.replace("*(float4*)(C_ptr + (", "*(float4*)(C_ptr + 1 + ("), "main_kernel", grid,
                               block, dyn, tensors, {b.name + "_ptr": (b.name, "float") for b in func.params})
    assert any(p.startswith("MISALIGNED 16-byte store global:C") for p in problems), sorted(problems)[:5]


def test_only_our_pipelined_kernels_get_cp_async_without_tensor_cores(sm90, monkeypatch):
    """Our TIR pipeline lowers a SIMT kernel's async stage as cp.async only
    where simt_gemm marked the loop (tensor_core_smem.SIMT_ASYNC): MetaSchedule's
    SIMT candidates ask for async stages too, and TVM's lowering of theirs
    makes calls the CUDA codegen cannot print. Without the mark, the same
    kernel is lowered as TVM ships it: synchronous copies (between commit
    and wait groups of nothing), the same sums."""
    from deploy.passes.tensor_core_smem import SIMT_ASYNC

    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    monkeypatch.setattr(simt_gemm, "STAGES", 2)
    func = _matmul(200, 136, 40)
    sch = SimtGemm().apply(func, sm90)
    (ko,) = [lp for lp in sch.get_loops(sch.get_sblock("C_update")) if SIMT_ASYNC in sch.get(lp).annotations]
    sch.unannotate(ko, SIMT_ASYNC)
    src = emulation.source(sch.mod["main"], sm90)
    assert "software_pipeline_async_stages" in sch.mod["main"].script() and "ptx_cp_async_legacy" not in src, src[:3000]
    args = emulation.reference(func)
    got, problems = emulation.run(func, sch.mod["main"], sm90, args, src)
    assert np.array_equal(got, args[-1]) and not problems, problems


def test_tvm_copies_a_strided_vector_by_cp_async_as_if_contiguous(sm90, monkeypatch):
    """Why a copy along rows takes only rows at a stride of 1
    (`_rows_contiguous`): copied along its rows, 2 floats apart, the NCHW
    1x1 convolution at stride 2 gets a 16-byte cp.async of the 4 floats at
    the vector's base from TVM 0.27's async-copy lowering (its plain
    lowering gathers the 4 right ones): wrong outputs, no problem the
    emulation can see. Fails once TVM lowers such a copy correctly or
    refuses it."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    monkeypatch.setattr(simt_gemm, "STAGES", 2)
    monkeypatch.setattr(simt_gemm, "_rows_contiguous", lambda copy: copy.iter_vars[1].var in
                        simt_gemm.vars_of(copy.reads[0].region[-1].min))  # (any row in the innermost index)
    func = _conv_nchw_1x1()
    scheduled = SimtGemm().apply(func, sm90).mod["main"]
    src = emulation.source(scheduled, sm90)
    assert "ptx_cp_async_legacy_cg_16_4_4(" in src, src[:3000]
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert not problems and not np.allclose(got, args[-1]), problems


def _dense_gelu(m, n, k):
    """A dense layer with its bias and exact GELU, `0.5 x (1 + erf(x / sqrt 2))`
    (an fp32 transformer's or wav2vec's): an epilogue calling `erff`."""
    from tvm import te

    f32 = lambda v: tvm.tirx.const(v, "float32")  # noqa: E731
    a = te.placeholder((_i64(m), _i64(k)), "float32", name="A")
    b = te.placeholder((_i64(k), _i64(n)), "float32", name="B")
    bias = te.placeholder((_i64(n),), "float32", name="bias")
    r = te.reduce_axis((_i64(0), _i64(k)), name="k")
    mm = te.compute((_i64(m), _i64(n)), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")
    z = te.compute(mm.shape, lambda i, j: mm[i, j] + bias[j], name="biased")
    g = te.compute(mm.shape, lambda i, j: f32(0.5) * z[i, j] * (f32(1) + tvm.tirx.erf(z[i, j] * f32(0.5 ** 0.5))),
                   name="gelu")
    return te.create_prim_func([a, b, bias, g])


def test_a_gelu_epilogue_is_applied_as_each_output_is_written(sm90, monkeypatch):
    """The epilogue's `erff` in the emulation (CUDA's within 2 ulp of the
    correctly rounded value), against TVM's CPU lowering of erf (a
    polynomial): close, not bit for bit."""
    monkeypatch.setattr(simt_gemm, "MIN_BLOCKS", 1)
    func = _dense_gelu(200, 136, 40)
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SIMT_GEMM
    src = emulation.source(scheduled, sm90)
    assert "erff(" in src, src[:3000]
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    assert not problems
    np.testing.assert_allclose(got, args[-1], rtol=1e-5, atol=1e-6)


def _shared_name(src: str) -> str:
    return re.search(r"__shared__ alignas\(64\) float (\w+)\[", src).group(1)


def test_the_blocks_are_one_grid_axis(sm90):
    """CUDA's grid stops at 65,535 blocks along y: a 512 x 512 image at
    batch 32 needs 65,536 of 128 x 64 (x: up to 2^31 - 1)."""
    sch = SimtGemm().apply(_conv(n=32, size=512, c=32, o=64), sm90)
    assert sch is not None
    grid, block, _ = emulation.launch(sch.mod["main"], sm90)
    assert grid == 32 * 512 * 512 // 128 and block == (16, 16)  # (an int: no blocks along y)


def test_a_batch_of_small_gemms_counts_every_gemms_blocks():
    assert simt_gemm.choose_tile(2048, 128, batch=4096) == (128, 128)
    assert simt_gemm.choose_tile(2048, 128) is None  # (16 blocks of 128 x 128, 64 of 64 x 64)


@pytest.mark.parametrize("m, n, want", [
    (200704, 64, (128, 64)),  # ResNet-50's first stage at batch 64: 64 channels
    (50176, 256, (128, 128)),
    (3136, 512, (64, 128)),  # the last stage: 128 x 128 tiles would give 100 blocks
    (3136, 2048, (128, 128)),  # (3,200 rows: 2% padding)
    (520, 4096, (64, 128)),  # 640 rows would be 11% more than 576
    (49, 512, None),  # batch 1: even 64 x 64 tiles give 8 blocks (DLight's Matmul takes it)
])
def test_the_tile_is_the_largest_that_fills_the_gpu_and_pads_least(m, n, want):
    assert simt_gemm.choose_tile(m, n) == want


@pytest.mark.parametrize("stages", [1, 2])
def test_resnet50s_largest_convolution_compiles_without_spilling(sm90, tmp_path, monkeypatch, stages):
    """The 3x3 convolution of ResNet-50's third stage at batch 64 compiled
    by nvcc for sm_90: a thread's 64 sums and operands in registers (no
    stack frame), few enough for two blocks an SM (117 registers; 125 with
    two stages)."""
    monkeypatch.setattr(simt_gemm, "STAGES", stages)
    func = _conv(n=64, size=28, c=256, o=256, k=3, stride=2)
    sch = SimtGemm().apply(func, sm90)
    assert sch is not None
    usage = _nvcc_usage(emulation.source(sch.mod["main"], sm90), tmp_path)  # (nvcc's --resource-usage report)
    registers = int(re.search(r"Used (\d+) registers", usage).group(1))
    assert "0 bytes stack frame" in usage and registers <= 65536 // (2 * 256), usage


@pytest.mark.parametrize("what, func", [
    ("fp16: tensor cores' (our mma.sync GEMM or DLight's)", lambda: _conv(n=64, size=28, dtype="float16")),
    ("too few blocks for the GPU", lambda: _conv(n=1, size=7, c=512, o=512)),
    ("a sum of exp(a * b): the zeros K is padded with would add exp(0)",
     lambda: _matmul(4096, 256, 40, body=lambda x, y: tvm.tirx.exp(x * y))),
])
def test_declined(sm90, what, func):
    assert SimtGemm().apply(func(), sm90) is None, what


def test_the_switch_turns_the_rule_off(sm90, monkeypatch):
    func = _conv(n=64, size=28)
    assert _first_source(func, sm90)[0] == schedule.SIMT_GEMM
    monkeypatch.setattr(simt_gemm, "SIMT_GEMM", False)
    assert _first_source(func, sm90)[0] == "dlight.Matmul"


def test_dlight_gives_a_thread_4_x_4_outputs_of_an_fp32_convolution(sm90):
    """Why the rule exists: DLight's Matmul gives an fp32 convolution a
    32 x 64 tile, a thread 16 sums read from shared memory a float at a
    time. Fails once DLight schedules it otherwise; then time the two again."""
    from deploy.tvm_compat import dlight

    func = _conv(n=64, size=28)
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Matmul())(tvm.IRModule({"main": func}))
    src = emulation.source(mod["main"], sm90)
    assert re.search(r"float2 \w+_local_ptr\[8\];", src) and "__launch_bounds__(128)" in src, src[:3000]


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2])
def test_gpu_a_dense_layer(sm90, monkeypatch, stages):
    monkeypatch.setattr(simt_gemm, "STAGES", stages)
    _check_on_the_gpu(_dense_gelu(8192, 768, 256), sm90)  # (the corpus BERT's QKV projection at batch 64, a GELU)


def _check_on_the_gpu(func, sm90):
    """`func` scheduled by the rule, run on the GPU against TVM's CPU lowering."""
    from deploy.build import build_kernel

    sch = SimtGemm().apply(func, sm90)
    assert sch is not None
    args = emulation.reference(func)
    lib = build_kernel("k", sch.mod["main"], targets.resolve("cuda:sm_90"))
    got = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in args[:-1]] + [
        tvm.runtime.tensor(np.zeros_like(args[-1]), tvm.cuda(0))]
    lib["k"](*got)
    np.testing.assert_allclose(got[-1].numpy(), args[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("size, c, o, k, stride", [(56, 64, 64, 3, 1), (28, 256, 256, 3, 2), (14, 1024, 256, 1, 1)])
@pytest.mark.parametrize("stages", [1, 2])
def test_gpu_an_fp32_convolution(sm90, monkeypatch, size, c, o, k, stride, stages):
    monkeypatch.setattr(simt_gemm, "STAGES", stages)
    _check_on_the_gpu(_conv(n=64, size=size, c=c, o=o, k=k, stride=stride, pad=(k - 1) // 2), sm90)
