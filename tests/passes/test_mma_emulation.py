"""Our tensor-core GEMMs (passes/mma_gemm.py) in emulation, on the CPU machine.

Each kernel's CUDA, built as the package builds it, runs in
tests/cuda_emu.py (every thread; `cp.async` groups landing at their
`wait_group`; races between barriers; reads of copies still in flight;
ldmatrix and mma.sync per the PTX ISA), against the unscheduled kernel
lowered for the CPU: the fp16 tiles, the implicit GEMM's predicated
copies and the TF32 kernels. The `-m gpu` tests of test_mma_gemm.py,
test_implicit_gemm.py and test_tf32.py run them on a GPU.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploy.passes import mma_gemm

from .. import emulation
from ..conftest import load_script
from .test_implicit_gemm import _resnet_like_kernel


@pytest.fixture(scope="module")
def probe():
    return load_script("mma_gemm_probe")


def _scheduled(func, config, gemm=None, padding=None):
    sch = mma_gemm.schedule(func, gemm or mma_gemm.match(func), config, padding)
    return sch.mod["main"].with_attr("global_symbol", "main")


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


def _emulate(func, scheduled, target, src=None):
    """The scheduled kernel run in emulation on seeded inputs: (its output,
    TVM's CPU lowering's output of `func`, the problems found, the inputs)."""
    arrays = emulation.reference(func)
    got, problems = emulation.run(func, scheduled, target, arrays, src)
    return got, arrays[-1], problems, arrays[:-1]


# A GEMM + bias with K of 12 tiles of 32 (6 of 64): every configuration's ring wraps around twice.
@pytest.mark.parametrize("config, n", [
    ("128x128x32-w2x2-s4", 128),  # the tuner's tile: fragments double-buffered, ring of 4
    ("128x128x64-w2x2-s3", 128),  # ring of 3
    ("128x96x32-w4x1-s4", 96),
    ("128x128x32-w2x2-s4-f0", 128),  # fragments single-buffered
    ("128x256x32-w2x4-s3", 256),  # 8 warps
])
def test_each_configuration_computes_the_gemm(sm90, probe, config, n):
    m, k = 128, 384
    func = probe.gemm_func(m, n, k, "bias")
    scheduled = _scheduled(func, mma_gemm.CONFIGS.get(config) or mma_gemm.config_from_name(config))
    got, want, problems, _ = _emulate(func, scheduled, sm90)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def test_the_implicit_gemm_with_its_predicated_copies_and_epilogue(sm90):
    """ResNet's 3x3 convolution + bias + ReLU as our implicit GEMM: the
    im2col tile's padding zero-filled by the predicated copies."""
    func = _resnet_like_kernel()
    scheduled = _scheduled(func, mma_gemm.CONFIGS["128x64x32-w2x2-s4"])
    src = emulation.source(scheduled, sm90)
    assert "cp_async_legacy_pred" in src
    got, want, problems, _ = _emulate(func, scheduled, sm90, src)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)


def _tf32(x: np.ndarray) -> np.ndarray:
    """fp32 values rounded to TF32 as passes/tf32.py's loads round them (bits
    + 0x1000, finite values only), then read as the tensor cores read them
    (the low 13 mantissa bits dropped); as float64."""
    bits = x.astype(np.float32).view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    bits = np.where(finite, bits + np.uint32(0x1000), bits) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("config", ["128x128x32-w2x2-s4", "128x128x64-w2x2-s3"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["KN", "NK"])
def test_the_tf32_kernels_too(sm90, config, b_transposed):
    """An fp32 GEMM + bias + ReLU in TF32 (passes/tf32.py): B [K, N] read a
    word at a time, B [N, K] by ldmatrix; each operand rounded to nearest
    TF32 as it is loaded, which the result shows: equal to that product
    to fp32's accumulation error, and off the strict fp32 result by more."""
    from .test_tf32 import _gemm

    func = _gemm(m=128, n=128, k=384, b_transposed=b_transposed)
    scheduled = _scheduled(func, mma_gemm.CONFIGS[config])
    src = emulation.source(scheduled, sm90)
    assert "tf32.tf32" in src
    assert ('"=r"(((unsigned *)(B_shared_dyn_warp_ptr' in src) == b_transposed  # (ldmatrix writes B's fragments)
    got, strict, problems, (a, b, bias) = _emulate(func, scheduled, sm90, src)
    assert not problems, sorted(problems)[:5]
    want = np.maximum(_tf32(a) @ (_tf32(b).T if b_transposed else _tf32(b)) + bias, 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - strict).max() > 1e-4


def test_the_emulation_sees_a_tile_read_before_its_copy_has_landed(sm90, probe):
    """The check that makes the ones above mean something: the K loop
    waiting for one group fewer reads tile k + 1 while it may still be in
    flight; without its first barrier, the copies overwrite a stage other
    warps are still reading."""
    func = probe.gemm_func(128, 128, 256, "bias")
    scheduled = _scheduled(func, mma_gemm.CONFIGS["128x128x32-w2x2-s4"])
    src = emulation.source(scheduled, sm90)
    loop = _main_loop(src)
    (w,) = _waits(loop)
    broken = src.replace(loop, loop.replace(f"wait_group_{w}();", f"wait_group_{w + 1}();"))
    _, _, problems, _ = _emulate(func, scheduled, sm90, broken)
    assert any("in flight" in p for p in problems), sorted(problems)[:5]
    broken = src.replace(loop, loop.replace("__syncthreads();", ";", 1))
    _, _, problems, _ = _emulate(func, scheduled, sm90, broken)
    assert any("RACE WAR cp.async" in p for p in problems), sorted(problems)[:5]


@pytest.mark.parametrize("m, n, k", [(100, 80, 96), (196, 112, 40)], ids=["columns", "columns-and-k"])
def test_a_gemm_whose_columns_and_k_no_tile_divides_is_padded_inside_the_kernel(sm90, probe, m, n, k):
    """EfficientNet-B0's 1x1 convolutions at batch 1 (40 to 112 channels):
    rows, columns and K padded to multiples of ROW_TILE, COL_TILE and
    K_TILE inside the kernel (`plan`); the padding reads zeros and is
    never written out."""
    func = probe.gemm_func(m, n, k, "bias")
    gemm, padding = mma_gemm.plan(func)
    assert (gemm.m, gemm.n, gemm.k) == (-(-m // 64) * 64, -(-n // 64) * 64, -(-k // 32) * 32)
    assert padding is not None and padding.count(1) == (k % 32 == 0)
    scheduled = _scheduled(func, mma_gemm.default_config(gemm, sm90), gemm, padding)
    got, want, problems, _ = _emulate(func, scheduled, sm90)
    assert not problems, sorted(problems)[:5]
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2e-3, atol=2e-3)
