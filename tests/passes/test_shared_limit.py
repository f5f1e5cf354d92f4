"""passes/shared_limit.py: kernels whose static and dynamic shared memory
together pass 48 KB, the dynamic part under it, declare 48 KB dynamic."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import targets
from deploy.passes import shared_limit, tensor_core_smem
from deploy.tvm_compat import PassContext, te, tvm

from ..conftest import load_script


def _kernel(rows: int, keys: int, head_dim: int = 64):
    """The fused attention kernel of Q, K and V [1, 4, n, d] (fp16), scheduled
    as the package schedules it (scripts/attention_probe.py's)."""
    probe = load_script("attention_probe")
    return probe.kernel((1, 4, rows, keys, head_dim), *probe.VARIANTS["4 warps"]).with_attr(
        "global_symbol", "main").with_attr("tirx.is_scheduled", True)


def _launch(lowered) -> str:
    return next(line.strip() for f in lowered.functions.values() for line in f.script(show_meta=False).splitlines()
                if "call_ffi_kernel" in line)


def _lowered(func, target, ours: bool):
    """`func` through our TIR pipeline, or through TVM's as our pipeline
    lowers a tensor-core kernel (its options) but without the declaration."""
    from deploy.tvm_compat import default_tir_pipeline

    func = func.with_attr("target", target)
    with target, PassContext(opt_level=3):
        if ours:
            return tensor_core_smem._pipeline_factory()[0](tvm.IRModule({"main": func}))
        with tensor_core_smem.tensor_core_context(no_cse=True):
            return default_tir_pipeline()[0](tvm.IRModule({"main": func}))


def test_a_kernel_over_the_limit_by_its_static_part_declares_48_kb():
    """BERT's attention at 128 tokens: 17.5 KB of static probabilities
    beside 32 KB of dynamic scores. TVM's own launch asks for the 32 KB
    (the runtime then refuses the 49.5 KB); ours for 48 KB."""
    target = targets.resolve("cuda:sm_90").tvm_target()
    func = _kernel(128, 128)
    stock = _lowered(func, target, ours=False)
    assert shared_limit.short_of_limit(stock) == {"main": 32768}, _launch(stock)
    ours = _lowered(func, target, ours=True)
    assert shared_limit.short_of_limit(ours) == {}
    assert ", 49152, launch_params=" in _launch(ours)


def test_kernels_within_the_limit_are_left_as_they_were():
    target = targets.resolve("cuda:sm_90").tvm_target()
    func = _kernel(64, 64)  # 9.5 KB static, 18 KB dynamic
    assert _launch(_lowered(func, target, ours=True)) == _launch(_lowered(func, target, ours=False))


def test_static_bytes_counts_every_static_allocation():
    text = 'buf = T.alloc_shared((17920,), "uint8")\nred = T.alloc_shared((64,))\nd = T.alloc_buffer((9,), scope="shared.dyn")'
    assert shared_limit.static_bytes(text) == 17920 + 64 * 4


def test_only_a_one_kernel_schedule_is_declared():
    x = te.placeholder((8,), "float32", name="x")
    y = te.compute((8,), lambda i: x[i] + 1, name="y")
    assert shared_limit.declare(te.create_prim_func([x, y])) is None  # (no loop bound to blockIdx)


def _run(func, target, ours: bool):
    """Build `func` (with or without the declaration) and run it on the GPU:
    its output and the reference, or the launch's error."""
    import torch

    name = tensor_core_smem.register()
    if not ours:
        original = shared_limit.short_of_limit
        shared_limit.short_of_limit = lambda lowered: {}
    try:
        with PassContext(opt_level=3):
            lib = tvm.compile(tvm.IRModule({"main": func}), target=target, tir_pipeline=name)
    finally:
        if not ours:
            shared_limit.short_of_limit = original
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 128, 64)).astype("float16") for _ in range(3))
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.zeros((1, 128, 4, 64), "float16"), dev)
    lib["main"](*(tvm.runtime.tensor(a, dev) for a in (q, k, v)), out)
    dev.sync()
    t = [torch.from_numpy(a).float() for a in (q, k, v)]
    ref = torch.softmax(t[0] @ t[1].transpose(-1, -2), dim=-1) @ t[2]
    return out.numpy().astype("float32"), ref.permute(0, 2, 1, 3).numpy()


@pytest.mark.gpu
def test_gpu_tvm_launch_fails_without_the_declaration():
    """Fails once TVM's runtime lifts the limit for static and dynamic
    shared memory together: then passes/shared_limit.py can go."""
    target = targets.resolve("cuda").tvm_target()
    func = _kernel(128, 128)
    with pytest.raises(Exception, match="CUDA_ERROR_INVALID_VALUE"):
        _run(func, target, ours=False)
    got, want = _run(func, target, ours=True)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
