"""deploy/passes/gpu_columns.py: the CUDA default schedule of sums and
means over an NHWC feature map's pixels, on the CPU machine (emulated:
tests/emulation.py) and, with `-m gpu`, on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import targets
from deploy.passes import gpu_columns, schedule
from deploy.passes.gpu_columns import ColumnSums
from deploy.tvm_compat import relax, tvm

from .. import emulation
from . import test_flat_gemm as graphs
from .test_gpu_default import _first_source, _kernels

SQUEEZE = """
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(SHAPE, "float16")):
        with R.dataflow():
            a = R.astype(x, "float32")
            m = R.mean(a, axis=[1, 2], keepdims=True)
            s = R.astype(m, "float16")
            z = R.multiply(x, R.const(2.0, "float16"))
            R.output(s, z)
        return (s, z)
"""


def _squeeze(_target, shape, _dtype="float16"):
    """Squeeze-excitation's squeeze kernel as the pipeline makes it in fp16
    (passes/mean_cast.py): fp16 read, summed in fp32, the mean cast back."""
    from deploy.passes.mean_cast import fuse_mean_casts

    mod = graphs._fused(fuse_mean_casts()(graphs._parse(SQUEEZE.replace("SHAPE", str(tuple(shape))))))
    return {n: f for n, f in graphs._kernels(mod).items() if "mean" in n}


def _pool_sum(target, shape, dtype):
    return _kernels(lambda bb, x: relax.op.sum(x, axis=[1, 2]), target, shape, dtype)


def _pool_max(target, shape, dtype):
    return _kernels(lambda bb, x: relax.op.max(x, axis=[1, 2], keepdims=True), target, shape, dtype)


# (the emulator runs every thread block of the kernel in Python: small shapes)
CASES = [
    ("a squeeze over 56 x 56 pixels, 24 channels", _squeeze, (1, 56, 56, 24), "float16", 6, 512),
    ("a squeeze over 14 x 14 pixels of 2 images", _squeeze, (2, 14, 14, 40), "float16", 20, 32),
    ("a global sum pool in fp32, 7 x 7", _pool_sum, (2, 7, 7, 12), "float32", 6, 32),
    ("channels no vector divides: 2 a thread", _squeeze, (1, 16, 16, 6), "float16", 3, 32),
    ("a global max pool in fp16 (another reducer)", _pool_max, (2, 9, 9, 8), "float16", 4, 32),
]


@pytest.mark.parametrize("what, build, shape, dtype, blocks, threads", CASES, ids=[c[0] for c in CASES])
def test_a_sum_over_pixels_gets_blocks_of_channels_and_computes_what_tvms_plain_lowering_does(
        sm90, what, build, shape, dtype, blocks, threads):
    """Each thread block sums a vector of channels over every pixel, its
    threads splitting the pixels, the vector loaded at once; what TVM's
    plain lowering for the CPU computes, but for the order of the fp32
    sums (the last bits may differ, as DLight's Reduction's do)."""
    (func,) = build(sm90, shape, dtype).values()
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.COLUMN_SUMS, what
    grid, block, _ = emulation.launch(scheduled, sm90)
    assert (grid, block) == (blocks, (threads, 1)), what
    src = emulation.source(scheduled, sm90)
    lanes = shape[-1] * shape[0] // blocks
    loaded = {("float16", 4): "half4", ("float16", 2): "half2", ("float32", 4): "float4"}[dtype, lanes]
    assert f"*({loaded}*)" in src, src  # (the vector loaded at once)
    args = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, sm90, args, src)
    np.testing.assert_allclose(got.astype("float32"), args[-1].astype("float32"), rtol=1e-3, atol=1e-3)
    assert not emulation.real_problems(problems), problems  # (TVM's allreduce: one benign uninitialized read)


def test_rule_kernels_passes_a_sum_in_another_order_within_rtol_and_the_benign_allreduce_read(sm90):
    """scripts/rule_kernels.py on a ColumnSums kernel: TVM's allreduce's one
    uninitialized read is noted as benign, not a failure; with --rtol a last-
    bits difference of the summation order passes, without it only equality."""
    import shutil

    from ..conftest import load_script

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here")
    script = load_script("rule_kernels")
    (func,) = _squeeze(sm90, (1, 56, 56, 24)).values()
    sch = ColumnSums().apply(func, sm90)
    found, ok = script.check(func, sch, sm90, emulate=True, rtol=1e-3)
    assert ok and "benign: UNINIT local read red_buf0_ptr_1" in found and "nvcc ok" in found, found
    found, ok = script.check(func, sch, sm90, emulate=True)
    assert ok == found.startswith("equal"), found


@pytest.mark.parametrize("what, build, shape", [
    ("a sum over the last axis (a row: DLight's Reduction reads it coalesced)",
     lambda bb, x: relax.op.sum(x, axis=[-1]), (64, 1024)),
    ("a contraction (a matmul with few rows)", lambda bb, x: relax.op.matmul(
        x, relax.const(np.ones((1024, 64), "float16"))), (4, 1024)),
    ("a short reduction over many outputs (a 3x3 pool: ShortReduction's)", lambda bb, x: relax.op.nn.avg_pool2d(
        x, pool_size=3, strides=1, padding=1, layout="NHWC"), (8, 28, 28, 64)),
])
def test_other_reductions_are_not_taken(sm90, what, build, shape):
    for name, func in _kernels(build, sm90, shape).items():
        assert ColumnSums().apply(func, sm90) is None, (what, name)


def test_dlight_gives_a_squeeze_16_threads_walking_every_pixel(sm90):
    """Why the rule exists: DLight's Reduction gives a block 16 channels and
    16 threads along the pixels (threadIdx.y), each walking 1/16 of them
    one element at a time. Fails once DLight schedules it otherwise; then
    look again at whether the rule is still needed."""
    from deploy.tvm_compat import dlight

    (func,) = _squeeze(sm90, (1, 56, 56, 144)).values()
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.Reduction())(tvm.IRModule({"main": func}))
    text = mod["main"].script()
    assert 'T.thread_binding(T.int64(9), thread="blockIdx.x")' in text
    assert 'T.thread_binding(T.int64(16), thread="threadIdx.y")' in text
    assert "T.grid(T.int64(196), 1)" in text or "range(T.int64(196))" in text, text


def test_the_switch_turns_the_rule_off(sm90, monkeypatch):
    (func,) = _squeeze(sm90, (1, 14, 14, 40)).values()
    monkeypatch.setattr(gpu_columns, "COLUMN_SUMS", False)
    assert ColumnSums().apply(func, sm90) is None
    assert _first_source(func, sm90)[0] == "dlight.Reduction"


@pytest.mark.parametrize("steps, threads", [(49, 32), (196, 32), (3136, 512), (12544, 512), (784, 128)])
def test_threads_cover_the_pixels_about_eight_a_thread(steps, threads):
    assert gpu_columns.threads_for(steps) == threads


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 112, 112, 32), (32, 7, 7, 1280), (1, 56, 56, 144)])
def test_gpu_a_squeeze(sm90, shape):
    (func,) = _squeeze(sm90, shape).values()
    from deploy.build import build_kernel

    args = emulation.reference(func, scale=1.0)
    sch = ColumnSums().apply(func, sm90)
    lib = build_kernel("k", sch.mod["main"], targets.resolve("cuda:sm_90"))
    got = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in args[:-1]] + [tvm.runtime.tensor(
        np.zeros_like(args[-1]), tvm.cuda(0))]
    lib["k"](*got)
    np.testing.assert_allclose(got[-1].numpy().astype("float32"), args[-1].astype("float32"), rtol=2e-3, atol=2e-3)
