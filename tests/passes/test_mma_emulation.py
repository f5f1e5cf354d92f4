"""passes/pipeline_sync.py: one barrier a K step in our cp.async pipelines.

The kernels run in tests/cuda_emu.py's emulation of their CUDA (every
thread, `cp.async` groups landing at their `wait_group`, races between
barriers, reads of copies still in flight), so their results and their
synchronisation are checked on the CPU machine; the `-m gpu` tests of
test_mma_gemm.py and test_implicit_gemm.py run them on the GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploy import targets
from deploy.passes import mma_gemm, pipeline_sync
from deploy.tuning import builder as tune_builder
from deploy.tvm_compat import tvm

from .. import cuda_emu
from ..conftest import load_script
from .test_attention import _launch
from .test_implicit_gemm import _resnet_like_kernel


@pytest.fixture(scope="module")
def sm90():
    return targets.resolve("cuda:sm_90").tvm_target()


@pytest.fixture(scope="module")
def probe():
    return load_script("mma_gemm_probe")


def _scheduled(func, config, stock=False):
    sch = mma_gemm.schedule(func, mma_gemm.match(func), config)
    out = sch.mod["main"].with_attr("global_symbol", "main")
    return out.with_attr(pipeline_sync.STOCK, 1) if stock else out


def _source(func, target) -> str:
    return tune_builder.lean_build(tvm.IRModule({"main": func}), target, None).imports[0].inspect_source()


def _main_loop(src: str) -> str:
    """The text of the kernel's K loop (the loop that commits cp.async groups)."""
    for found in re.finditer(r"for \(int \w+ = 0; \w+ < \d+; \+\+\w+\) \{", src):
        depth = 0
        for end in range(found.end() - 1, len(src)):
            depth += {"{": 1, "}": -1}.get(src[end], 0)
            if depth == 0:
                break
        body = src[found.end():end]
        if "commit_group();" in body and "__syncthreads" in body:
            return body
    raise AssertionError("no pipelined loop in the source")


def _waits(loop: str) -> list[int]:
    return [int(n) for n in re.findall(r"wait_group_(\d+)\(\);", loop)]


def _emulate(func, scheduled, target, src=None, seed=0):
    """The scheduled kernel's CUDA run in emulation on seeded inputs; returns
    (its output, the CPU lowering's output of `func`, the problems found)."""
    from deploy.tvm_compat import ms

    info = ms.arg_info.ArgInfo.from_prim_func(func)
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal([int(d) for d in a.shape]) / 4).astype(str(a.dtype)) for a in info]
    arrays[-1][...] = 0
    cpu = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    want = [tvm.runtime.tensor(a) for a in arrays]
    cpu["main"](*want)
    src = src or _source(scheduled, target)
    grid, block, dyn = _launch(scheduled, target)
    tensors, params = {}, {}
    for buf, a in zip(func.params, arrays):  # (a PrimFunc's params are its buffers)
        tensors[buf.name] = a.view(np.uint8).ravel().copy()
        params[buf.name + "_ptr"] = (buf.name, {"float16": "half", "float32": "float"}[str(buf.dtype)])
    out_name = func.params[-1].name
    tensors[out_name][:] = 0xFF
    problems, written = cuda_emu.run(src.replace("main_kernel", "k_kernel"), "k_kernel", grid, block, dyn, tensors,
                                     params)
    assert (written[out_name] == 1).all(), "every output element written once"
    got = tensors[out_name].view(arrays[-1].dtype).reshape(arrays[-1].shape)
    return got, want[-1].numpy(), problems


# A GEMM + bias with K of 8 tiles of 32 (4 of 64): every configuration's ring wraps around twice.
@pytest.mark.parametrize("config, n", [
    ("128x128x32-w2x2-s4", 128),  # the tuner's tile: fragments double-buffered, ring of 4
    ("128x128x64-w2x2-s3", 128),  # ring of 3 (wait_group 1 -> 0)
    ("128x96x32-w4x1-s4", 96),
    ("128x128x32-w2x2-s4-f0", 128),  # fragments single-buffered
    ("128x256x32-w2x4-s3", 256),  # 8 warps
])
def test_each_configuration_computes_the_gemm_with_one_barrier_a_k_step(sm90, probe, config, n):
    m, k = 128, 256
    func = probe.gemm_func(m, n, k, "bias")
    cfg = mma_gemm.CONFIGS.get(config) or mma_gemm.config_from_name(config)
    scheduled = _scheduled(func, cfg)
    src = _source(scheduled, sm90)
    loop, stock_loop = _main_loop(src), _main_loop(_source(_scheduled(func, cfg, stock=True), sm90))
    assert loop.count("__syncthreads();") == 1 and stock_loop.count("__syncthreads();") == 2
    assert _waits(loop) == [w - 1 for w in _waits(stock_loop)]
    # the wait and its barrier come before the copies
    assert loop.index("wait_group") < loop.index("__syncthreads") < loop.index("ptx_cp_async_legacy")
    got, want, problems = _emulate(func, scheduled, sm90, src)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_the_implicit_gemm_with_its_predicated_copies_and_epilogue(sm90):
    """ResNet's 3x3 convolution + bias + ReLU as our implicit GEMM: the
    im2col tile's padding zero-filled by the predicated copies."""
    func = _resnet_like_kernel()
    scheduled = _scheduled(func, mma_gemm.CONFIGS["128x64x32-w2x2-s4"])
    src = _source(scheduled, sm90)
    assert _main_loop(src).count("__syncthreads();") == 1 and "cp_async_legacy_pred" in src
    got, want, problems = _emulate(func, scheduled, sm90, src)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("config", ["128x128x32-w2x2-s4", "128x128x64-w2x2-s3"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["KN", "NK"])
def test_the_tf32_kernels_too(sm90, config, b_transposed):
    """An fp32 GEMM + bias + ReLU in TF32 (passes/tf32.py): its operands
    rounded to TF32 as they are loaded, B [K, N] a word at a time, B [N, K]
    by ldmatrix; within TF32's error of the strict fp32 result."""
    from .test_tf32 import _gemm

    func = _gemm(m=128, n=128, k=256, b_transposed=b_transposed)
    scheduled = _scheduled(func, mma_gemm.CONFIGS[config])
    src = _source(scheduled, sm90)
    assert _main_loop(src).count("__syncthreads();") == 1 and "tf32.tf32" in src
    got, want, problems = _emulate(func, scheduled, sm90, src)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)


def test_the_emulation_sees_a_tile_read_before_its_copy_has_landed(sm90, probe):
    """The check that makes the ones above mean something: the rewritten
    loop waiting for one group fewer (the count TVM had before the copies
    moved after the wait) reads tile k + 1 while it may still be in flight."""
    func = probe.gemm_func(128, 128, 256, "bias")
    scheduled = _scheduled(func, mma_gemm.CONFIGS["128x128x32-w2x2-s4"])
    src = _source(scheduled, sm90)
    loop = _main_loop(src)
    (w,) = _waits(loop)
    broken = src.replace(loop, loop.replace(f"wait_group_{w}();", f"wait_group_{w + 1}();"))
    _, _, problems = _emulate(func, scheduled, sm90, broken)
    assert any("in flight" in p for p in problems), sorted(problems)[:5]
    # and without the barrier, the copies overwrite a stage other warps are still reading
    broken = src.replace(loop, loop.replace("__syncthreads();", ";"))
    _, _, problems = _emulate(func, scheduled, sm90, broken)
    assert any("RACE" in p for p in problems), sorted(problems)[:5]


def test_a_pipeline_with_nothing_left_in_flight_is_left_as_tvm_lowers_it(sm90, probe):
    """A 2-stage ring with double-buffered fragments waits for every group
    (wait_group 0) in its loop: the wait cannot move before the commit, so
    the loop keeps TVM's two barriers."""
    func = probe.gemm_func(128, 128, 256, "bias")
    loop = _main_loop(_source(_scheduled(func, probe.CONFIGS["128x128x32-w2x2-s2"]), sm90))
    assert loop.count("__syncthreads();") == 2 and _waits(loop) == [0]


def test_tvm_still_puts_two_barriers_in_each_k_step(sm90, probe):
    """Fails once TVM's own lowering (ThreadSync) puts one barrier in the
    loop of a 4-stage ring: then this pass can go."""
    func = probe.gemm_func(128, 128, 256, "bias")
    loop = _main_loop(_source(_scheduled(func, mma_gemm.CONFIGS["128x128x32-w2x2-s4"], stock=True), sm90))
    assert loop.count("__syncthreads();") == 2


def test_the_environment_builds_every_kernel_with_tvms_barriers(sm90, probe, monkeypatch):
    """DEPLOY_PIPELINE_SYNC=stock (a package built both ways, to measure
    the pass) leaves every loop as TVM lowers it; a value it does not know
    is refused in one line."""
    func = _scheduled(probe.gemm_func(128, 128, 256, "bias"), mma_gemm.CONFIGS["128x128x32-w2x2-s4"])
    monkeypatch.setenv(pipeline_sync.ENV, "stock")
    assert _main_loop(_source(func, sm90)).count("__syncthreads();") == 2
    monkeypatch.setenv(pipeline_sync.ENV, "two")
    with pytest.raises(ValueError, match="expected 'stock'"):
        pipeline_sync.stock_everywhere()
