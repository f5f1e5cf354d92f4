"""deploy/passes/cpu_reduction.py: normalization statistics computed once,
vectorized, and to the same values as TVM's own lowering; softmax and GPU
targets left alone; and the DLight defect the rule works around still there."""

from __future__ import annotations

import math

import pytest
from tvm import te, topi

from deploy.passes import schedule
from deploy.passes.cpu_reduction import SumStatistics
from deploy.tvm_compat import dlight, s_tir, tirx

from .test_cpu_default import _check


def _instance_norm_nchwc(shape=(1, 2, 8, 8, 4)):
    """An instance norm in NCHWc as the frontend fuses it: the mean over each
    channel's pixels, subtracted from every pixel, divided by a deviation."""
    x = te.placeholder(shape, name="x")
    d = te.placeholder((1, shape[1], 1, 1, shape[4]), name="d")
    mean = topi.divide(topi.sum(x, axis=(2, 3), keepdims=True), shape[2] * shape[3])
    y = topi.divide(topi.subtract(x, mean), d)
    return te.create_prim_func([x, d, y])


def _executions(sch, name: str) -> tuple[int, int]:
    """(how many times the block runs in the schedule, its own domain): the
    product of the loops above it, and of its iteration extents (the
    update's, where its initialization was split off)."""
    try:
        block = sch.get_sblock(name + "_update")
    except Exception:  # noqa: BLE001 - not decomposed
        block = sch.get_sblock(name)
    above = math.prod(int(sch.get(lp).extent) for lp in sch.get_loops(block))
    return above, math.prod(int(iv.dom.extent) for iv in sch.get(block).iter_vars)


def _reduction_block(func) -> str:
    sch = s_tir.Schedule(func)
    blocks = [sch.get(b) for b in sch.get_child_blocks(dlight.analysis.get_root_block(sch))]
    return next(b.name_hint for b in blocks if any(iv.iter_type != tirx.IterVar.DataPar for iv in b.iter_vars))


def test_dlight_still_recomputes_broadcast_statistics(llvm_target):
    """The defect SumStatistics works around: DLight's CPU Reduction runs an
    instance norm's sum under its output's rows, once per row. Fails once
    TVM computes it once; then `recomputed` kernels can go back to DLight."""
    func = _instance_norm_nchwc()
    sch = dlight.cpu.Reduction().apply(func, llvm_target.tvm_target(), False)
    assert sch is not None
    runs, domain = _executions(sch, _reduction_block(func))
    assert runs > domain


def test_an_instance_norm_in_nchwc_sums_once_along_the_channel_vector(llvm_target):
    func = _instance_norm_nchwc()
    sch = _check(func, llvm_target, rule=SumStatistics)
    runs, domain = _executions(sch, _reduction_block(func))
    assert runs == domain
    script = sch.mod.script()
    assert "T.vectorized" in script and '"local"' in script  # the channels' accumulators, a vector in registers


@pytest.mark.parametrize("rows,width", [(6, 96), (3, 512), (5, 40), (2, 30)])
def test_a_layer_norm_sums_its_rows_in_partial_vectors(llvm_target, rows, width):
    x = te.placeholder((rows, width), name="x")
    g = te.placeholder((width,), name="g")
    b = te.placeholder((width,), name="b")
    y = topi.nn.layer_norm(x, g, b, axis=[-1], epsilon=1e-5)
    sch = _check(te.create_prim_func([x, g, b, y]), llvm_target, rule=SumStatistics)
    assert "_rf" in sch.mod.script()  # rfactor's partial sums (40 floats: 8 of them, where a vector holds 16)


def test_a_group_norm_decomposed_as_onnx_writes_it(llvm_target):
    """Mean, subtract, square, sum, divide, add, sqrt, then the normalization:
    ONNX's GroupNormalization as the frontend gives it, in one kernel."""
    x = te.placeholder((1, 4, 256), name="x")
    mean = topi.divide(topi.sum(x, axis=2, keepdims=True), 256)
    dev = topi.subtract(x, mean)
    std = topi.sqrt(topi.add(topi.divide(topi.sum(topi.multiply(dev, dev), axis=2, keepdims=True), 256), 1e-5))
    y = topi.divide(topi.subtract(x, mean), std)
    _check(te.create_prim_func([x, y]), llvm_target, rule=SumStatistics)


def test_a_mean_over_tokens_takes_the_channels_as_its_vector(llvm_target):
    """MLP-Mixer's pooling: [1, 196, 64] averaged over its 196 tokens."""
    x = te.placeholder((1, 196, 64), name="x")
    y = topi.divide(topi.sum(x, axis=1), 196)
    sch = _check(te.create_prim_func([x, y]), llvm_target, rule=SumStatistics)
    assert '"local"' in sch.mod.script()


@pytest.mark.parametrize("rows,width", [(12, 197), (4, 64)])
def test_a_softmax_computes_each_exponential_once(llvm_target, rows, width):
    x = te.placeholder((rows, width), name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x)])
    sch = _check(func, llvm_target, rule=SumStatistics)
    exp = next(b for b in ("T_softmax_exp", "T_fast_exp") if b in func.script())
    runs, domain = _executions(sch, exp)
    assert runs == domain  # read by the sum and the division, computed once at the root, not inlined into both


def test_gpu_targets_are_left_alone():
    from deploy.targets import cuda_for_arch

    cuda = cuda_for_arch("sm_90", "", False).tvm_target()
    assert SumStatistics().apply(_instance_norm_nchwc(), cuda, False) is None


def test_statistics_come_before_dlights_reduction_in_the_cpu_chain():
    chain = schedule.CHAINS["llvm"]
    assert chain.index(schedule.STATISTICS) + 1 == chain.index("dlight.Reduction")
    assert schedule.STATISTICS not in schedule.CHAINS["cuda"]


def test_a_pooling_window_is_left_to_dlight(llvm_target):
    """Average pools are sums too, over windows: 1.6x slower under this rule (DenseNet's)."""
    x = te.placeholder((1, 4, 8, 8, 8), name="x")
    y = topi.nn.pool2d(x, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "avg", layout="NCHW8c")
    assert SumStatistics().apply(te.create_prim_func([x, y]), llvm_target.tvm_target(), False) is None
