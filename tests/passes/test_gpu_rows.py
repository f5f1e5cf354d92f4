"""deploy/passes/gpu_rows.py: a warp a row for normalizations over short
rows, built for sm_90 here; on the GPU (`-m gpu`) against TVM's plain CPU
lowering."""

import numpy as np
import pytest

from deploy import targets
from deploy.build import build_kernel
from deploy.passes import schedule
from deploy.passes.gpu_rows import ShortRows
from deploy.tvm_compat import dlight, relax, tvm

from .test_gpu_default import _first_source, _kernels, _reference


def _layer_norm(channels):
    def build(bb, x):
        rng = np.random.default_rng(3)
        g = relax.const(rng.standard_normal(channels).astype("float16"))
        b = relax.const(rng.standard_normal(channels).astype("float16"))
        return relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-6)
    return build


def _softmax(bb, x):
    return relax.op.nn.softmax(x, axis=-1)


def _kernel(make, target, shape):
    (func,) = [f for n, f in _kernels(make, target, shape).items() if "norm" in n or "softmax" in n]
    return func


@pytest.mark.parametrize("what, make, shape", [
    ("ConvNeXt's LayerNorm, 96 channels", _layer_norm(96), (8, 28, 28, 96)),
    ("the same at batch 1 (a unit axis DLight's normalization drops)", _layer_norm(96), (1, 56, 56, 96)),
    ("ViT's LayerNorm, 384 features", _layer_norm(384), (8, 197, 384)),
    ("softmax over 197", _softmax, (8, 6, 197, 197)),
])
def test_a_normalization_over_short_rows_gets_a_warp_a_row(sm90, what, make, shape):
    """In the CUDA chain before DLight's GeneralReduction: 4 rows a block of
    128 threads, each row's sums a warp shuffle reduction, no shared-memory
    round trip; compiled for sm_90."""
    func = _kernel(make, sm90, shape)
    source, scheduled = _first_source(func, sm90)
    assert source == schedule.SHORT_ROWS, what
    rows = int(np.prod(shape[:-1]))
    text = scheduled.script()
    assert f'T.thread_binding(T.int64({rows // 4}), thread="blockIdx.x")' in text
    src = build_kernel("k", scheduled, targets.resolve("cuda:sm_90")).imports[0].inspect_source()
    assert "__launch_bounds__(128)" in src and "__shfl_down_sync" in src and "__syncthreads" not in src


def test_long_rows_and_few_rows_stay_with_general_reduction(sm90):
    assert ShortRows().apply(_kernel(_layer_norm(2048), sm90, (1024, 2048)), sm90) is None  # a row > MAX_ROW
    assert ShortRows().apply(_kernel(_layer_norm(96), sm90, (2, 8, 96)), sm90) is None  # 16 rows
    assert ShortRows().apply(_kernel(_layer_norm(96), sm90, (8, 28, 28, 96)), targets.resolve("llvm").tvm_target()) \
        is None


def test_general_reduction_gives_a_short_row_a_block_of_256(sm90):
    """Why the rule exists: DLight's GeneralReduction gives each of
    ConvNeXt's 96-channel rows a block of 256 threads. Fails once it does
    not; then look again at whether ShortRows is still needed."""
    func = _kernel(_layer_norm(96), sm90, (8, 28, 28, 96))
    with sm90:
        mod = dlight.ApplyDefaultSchedule(dlight.gpu.GeneralReduction())(tvm.IRModule({"main": func}))
    text = mod["main"].script()
    assert 'T.thread_binding(T.int64(6272), thread="blockIdx.x")' in text
    assert 'T.thread_binding(T.int64(256), thread="threadIdx.x")' in text


@pytest.mark.gpu
@pytest.mark.parametrize("make, shape", [(_layer_norm(96), (8, 28, 28, 96)), (_layer_norm(96), (1, 56, 56, 96)),
                                         (_layer_norm(384), (8, 197, 384)), (_softmax, (2, 6, 197, 197))],
                         ids=["ln96", "ln96-b1", "ln384", "softmax197"])
def test_the_warp_a_row_schedule_computes_what_tvms_plain_lowering_does(sm90, make, shape):
    func = _kernel(make, sm90, shape)
    args, want = _reference(func)
    with sm90:
        sch = ShortRows().apply(func, sm90)
    lib = build_kernel("k", sch.mod["main"], targets.resolve("cuda:sm_90"))
    dev = tvm.cuda(0)
    got = [tvm.runtime.tensor(a, dev) for a in args]
    lib["k"](*got)
    np.testing.assert_allclose(got[-1].numpy().astype("float32"), want[-1].numpy().astype("float32"),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("make, shape", [(_layer_norm(96), (1, 32, 32, 96)), (_layer_norm(384), (4, 256, 384)),
                                         (_softmax, (1, 8, 128, 197))], ids=["ln96", "ln384", "softmax197"])
def test_the_warp_a_row_kernel_computes_it_in_emulation(sm90, make, shape):
    """The schedule's CUDA run in tests/cuda_emu.py (each row reduced by a
    warp's shuffles), against TVM's plain CPU lowering: on the CPU machine,
    what the `-m gpu` test above checks on a GPU."""
    from .. import emulation

    func = _kernel(make, sm90, shape)
    args, want = _reference(func)
    with sm90:
        sch = ShortRows().apply(func, sm90)
    got, problems = emulation.run(func, sch.mod["main"], sm90, args)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want[-1].numpy().astype("float32"), rtol=2e-3, atol=2e-3)
