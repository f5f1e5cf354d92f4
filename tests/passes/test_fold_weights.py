"""deploy/passes/fold_weights.py: permute_dims, reshape and astype of
constants folded in NumPy give the constants TVM's FoldConstant computes,
bit for bit, and the optimize stage's module is the same with or without it."""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi

from deploy import config, optimize, targets
from deploy.passes import fold_weights as fw
from deploy.tvm_compat import relax, tvm


def _constants(mod) -> list[np.ndarray]:
    out = []

    def visit(expr):
        value = getattr(expr, "value", None)
        if hasattr(value, "numpy"):
            out.append(value.numpy())

    relax.analysis.post_order_visit(mod["main"], visit)
    return out


def _module(data: np.ndarray, build):
    bb = relax.BlockBuilder()
    with bb.function("main", []):
        with bb.dataflow():
            out = bb.emit_output(build(bb, relax.const(data)))
        bb.emit_func_output(out)
    return bb.get()


# fp32 -> fp16 ties, overflow to inf, subnormals, nan, signed zero
_HARD = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65519.0, 65520.0, -1e6, 1e-8, 6e-8, -0.0, np.nan, 3.14159],
                 dtype="float32")

CASES = {
    "astype fp32->fp16": (_HARD.reshape(2, 5), lambda bb, c: bb.emit(relax.op.astype(c, "float16"))),
    "astype fp16->fp32": (np.array([1.0, 65504.0, -0.0, np.nan, 6e-8], "float16"), lambda bb, c: bb.emit(relax.op.astype(c, "float32"))),
    "astype int64->fp16": (np.array([1, 2049, 70000, -3], "int64"), lambda bb, c: bb.emit(relax.op.astype(c, "float16"))),
    "scalar permute": (np.array(7, "int64"), lambda bb, c: bb.emit(relax.op.permute_dims(c, []))),
    "scalar reshape": (np.array(0.5, "float32"), lambda bb, c: bb.emit(relax.op.reshape(c, (1, 1)))),
    "permute": (np.arange(24, dtype="float32").reshape(2, 3, 4),
                lambda bb, c: bb.emit(relax.op.permute_dims(c, [2, 0, 1]))),
    "permute reversed": (np.arange(6, dtype="int32").reshape(2, 3), lambda bb, c: bb.emit(relax.op.permute_dims(c))),
    "layout_transform": (np.random.default_rng(1).standard_normal((32, 6, 3, 3)).astype("float32"),
                         lambda bb, c: bb.emit(relax.op.layout_transform(
                             c, index_map=lambda o, i, h, w: (o // 16, i // 3, h, w, i % 3, o % 16)))),
    "chain": (np.random.default_rng(0).standard_normal((8, 3, 3, 4)).astype("float32"),
              lambda bb, c: bb.emit(relax.op.astype(relax.op.reshape(relax.op.permute_dims(c, [0, 2, 3, 1]), (8, 36)),
                                                    "float16"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_folded_constants_are_what_fold_constant_computes(case):
    data, build = CASES[case]
    mod = _module(data, build)
    target = tvm.target.Target("llvm")
    with target:
        ref = relax.transform.FoldConstant()(mod)
        ours = fw.fold_weights()(mod)
    assert all(op not in ours.script() for op in ("R.permute_dims", "R.astype", "R.layout_transform"))
    (want,), (got,) = _constants(ref), _constants(relax.transform.FoldConstant()(ours))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_the_cast_of_a_0d_constant_is_left_as_fold_constant_leaves_it():
    """(TVM 0.27's FoldConstant does not fold it; folding it here would
    change the kernels that read it, and their tuning records' workloads.)"""
    mod = _module(np.array(0.1, "float32"), lambda bb, c: bb.emit(relax.op.astype(c, "float16")))
    with tvm.target.Target("llvm"):
        assert "R.astype" in relax.transform.FoldConstant()(mod).script()
    assert "R.astype" in fw.fold_weights()(mod).script()


def test_float_to_int_casts_are_left_to_fold_constant():
    mod = _module(np.array([1.5, -2.5], "float32"), lambda bb, c: bb.emit(relax.op.astype(c, "int32")))
    assert "R.astype" in fw.fold_weights()(mod).script()


def test_a_padded_or_merging_layout_transform_is_left_to_fold_constant():
    padded = _module(np.ones((10, 3), "float32"), lambda bb, c: bb.emit(relax.op.layout_transform(
        c, index_map=lambda o, i: (o // 4, i, o % 4), pad_value=0.0)))
    assert "R.layout_transform" in fw.fold_weights()(padded).script()
    assert fw._moved(tvm.tirx.IndexMap.from_func(lambda o, i: (o % 2, i, o // 2)), np.ones((3, 2))) is None


@pytest.mark.parametrize("model, kind", [("tiny_cnn", "cuda"), ("convnext", "cuda"), ("resnet18", "llvm")])
def test_the_optimize_stage_makes_the_same_module_with_and_without_it(tmp_path, monkeypatch, model, kind):
    """A frontend module through the optimize phases: CUDA fp16 NHWC
    (layout, fp16 casts, split-K; ConvNeXt's GELU and LayerNorm scalars) and
    the CPU's NCHWc (its weights' layout_transforms). Structurally equal,
    constants and their shapes included (a scalar stays 0-d)."""
    from deploy import export, frontend
    from deploy.tvm_compat import load_json

    cfg = config.from_dict({"model": {"source": model, "size": "small"},
                            kind: {"buckets": [2], "tune_buckets": [2], "trials": 0}})
    profile = getattr(cfg, kind)
    fe = frontend.run(profile, export.run(cfg, tmp_path / "export"), tmp_path / "frontend")
    (path,) = fe.modules.values()
    target = targets.resolve("cuda:sm_90" if kind == "cuda" else "llvm").tvm_target()
    ours, _ = optimize.optimize_module(load_json(path.read_text()), profile, target)

    @tvm.transform.module_pass(opt_level=0, name="Nothing")
    def nothing(mod, _ctx):
        return mod

    monkeypatch.setattr(optimize, "fold_weights", lambda: nothing)
    ref, _ = optimize.optimize_module(load_json(path.read_text()), profile, target)
    assert tvm_ffi.structural_equal(ours, ref)
