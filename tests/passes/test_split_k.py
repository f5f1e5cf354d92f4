"""Split-K for small-row NHWC convolutions (deploy.passes.split_k.split_k_conv2d):
the rewrite computes the same convolution, is applied only where it is
meant to be, and its batched matmul still gets tensor-core schedules."""

from __future__ import annotations

import numpy as np
import pytest

from deploy import config
from deploy.errors import ConfigError
from deploy.optimize import phases
from deploy.passes.split_k import split_k_conv2d


def _conv_module(c: int, o: int, k: int, stride: int, hw: int, groups: int = 1, dtype: str = "float32",
                 n: int = 1, w: int | None = None, padding: tuple | None = None, strides: tuple | None = None,
                 dilation: tuple = (1, 1)):
    pad = padding or (k // 2, k // 2, k // 2, k // 2)  # (top, left, bottom, right)
    st = strides or (stride, stride)
    # TVMScript cannot close over Python values in shapes: build the text.
    src = f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor(({n}, {hw}, {w or hw}, {c}), "{dtype}"), w: R.Tensor(({o}, {k}, {k}, {c // groups}), "{dtype}")):
        with R.dataflow():
            y = R.nn.conv2d(x, w, strides={st}, padding={pad}, dilation={dilation}, groups={groups},
                            data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC", out_dtype="float32")
            z = R.nn.relu(y)
            R.output(z)
        return z
"""
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script.parser import parse

    return parse(src, extra_vars={"I": I, "R": R})


def _run(mod, x, w):
    from deploy.tvm_compat import VirtualMachine, relax, tensor, tvm

    ex = tvm.compile(relax.transform.LegalizeOps()(mod), target="llvm")
    return VirtualMachine(ex, tvm.cpu())["main"](tensor(x), tensor(w)).numpy()


@pytest.mark.parametrize("k, stride, c, hw, extra", [
    (3, 1, 64, 7, {}),
    (3, 2, 64, 14, {}),
    (1, 1, 256, 7, {}),
    (1, 2, 256, 14, {}),
    (3, 1, 64, 7, {"padding": (0, 1, 2, 0)}),  # asymmetric: a 7x6 output
    (3, 2, 64, 8, {"padding": (0, 0, 1, 1)}),  # stride 2 over an even size
    (3, 1, 64, 6, {"n": 2, "w": 9, "strides": (2, 1), "padding": (1, 2, 0, 1)}),  # batch 2, not square
    (3, 1, 64, 7, {"dtype": "float16"}),  # fp16 inputs, fp32 accumulation (as after ToMixedPrecision)
])
def test_split_conv_computes_the_same(k, stride, c, hw, extra):
    mod = _conv_module(c, 32, k, stride, hw, **extra)
    new = split_k_conv2d(4, max_rows=256, min_k=256)(mod)
    text = new.script()
    assert "R.matmul" in text and "R.nn.conv2d" not in text
    assert "R.nn.conv2d" in mod.script()  # the input module is left as it was
    rng = np.random.default_rng(0)
    dtype = extra.get("dtype", "float32")
    x = rng.standard_normal((extra.get("n", 1), hw, extra.get("w", hw), c)).astype(dtype)
    w = rng.standard_normal((32, k, k, c)).astype(dtype)
    ref, got = _run(mod, x, w), _run(new, x, w)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("why, kwargs, build", [
    ("too many rows", {"max_rows": 48, "min_k": 256}, (64, 3, 1, 7, 1)),
    ("reduction too short", {"max_rows": 256, "min_k": 1024}, (64, 3, 1, 7, 1)),
    ("grouped", {"max_rows": 256, "min_k": 64}, (64, 3, 1, 7, 4)),
    ("K/parts not a multiple of 16", {"max_rows": 256, "min_k": 64}, (20, 3, 1, 7, 1)),
])
def test_other_convolutions_are_left_alone(why, kwargs, build):
    c, k, stride, hw, groups = build
    mod = _conv_module(c, 32, k, stride, hw, groups)
    assert "R.matmul" not in split_k_conv2d(4, **kwargs)(mod).script(), why


def test_split_k_phase_and_config():
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"split_k": 4}})
    assert [name for name, _ in phases(cfg.cuda)][-3:] == ["split_k", "epilogues", "fusion"]
    assert "split_k" not in [name for name, _ in phases(cfg.llvm)]  # off by default, and NCHW there
    with pytest.raises(ConfigError, match="invalid cuda.split_k"):
        config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"split_k": -1}})
    with pytest.raises(ConfigError, match="llvm.split_k needs the NHWC layout"):
        config.from_dict({"model": {"source": "tiny_cnn"}, "llvm": {"split_k": 4}})


def test_split_matmul_gets_tensor_core_schedules():
    """ResNet-50's last-stage 3x3 convolution at batch 1, split in 4, for
    sm_90: the batched matmul's design space is tensorized (WMMA). A grouped
    convolution, the other way to write the split, is not."""
    from deploy import targets
    from deploy.tvm_compat import ms, relax, tvm

    mod = _conv_module(512, 512, 3, 1, 7, dtype="float16")
    mod = split_k_conv2d(4)(mod)
    T = relax.transform
    mod = tvm.transform.Sequential([T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FoldConstant(), T.FuseOps(),
                                    T.FuseTIR()])(mod)
    target = targets.resolve("cuda:sm_90").tvm_target()
    (task,) = [t for t in ms.relax_integration.extract_tasks(mod, target) if "matmul" in t.task_name]
    ctx = ms.TuneContext(mod=task.dispatched[0], target=target, space_generator="post-order-apply", num_threads=1)
    assert any("wmma" in str(s.trace) for s in ctx.generate_design_space())


def test_split_conv_is_three_kernels_with_the_epilogue_fused_into_the_sum():
    """With constant weights (as in a model): im2col, the batched matmul, and
    the sum of the parts with the convolution's epilogue (here the ReLU) in
    one kernel; FuseOps keeps a reduction apart from what follows it, so a
    `sum` there would cost a fourth."""
    from deploy.tvm_compat import relax, tensor, tirx, tvm

    T = relax.transform
    w = np.random.default_rng(0).standard_normal((32, 3, 3, 64)).astype("float32")
    mod = T.BindParams("main", {"w": tensor(w)})(_conv_module(64, 32, 3, 1, 7))
    mod = split_k_conv2d(4, max_rows=256, min_k=256)(mod)
    mod = tvm.transform.Sequential([T.LegalizeOps(), T.FoldConstant(), T.AnnotateTIROpPattern(), T.FuseOps(),
                                    T.FuseTIR()])(mod)
    kernels = sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc))
    assert len(kernels) == 3, kernels
    assert sum("matmul" in k for k in kernels) == 1 and sum("concatenate" in k for k in kernels) == 1, kernels
    assert any("add" in k and "relu" in k for k in kernels), kernels
