"""deploy/passes/pack_weights.py: a CPU GEMM's constant weight packed into
column panels computes what the unpacked module computes, the default CPU
schedule takes the packed kernel, and kernels it cannot pack are left as
they are."""

from __future__ import annotations

import numpy as np
import pytest
import tvm_ffi
from tvm import te, topi

from deploy.passes import fold_weights, pack_weights
from deploy.tvm_compat import relax, tensor, tirx, tvm

from .test_cpu_default import _check


def _dense(m: int, k: int, n: int, transposed: bool = False, relu: bool = True, weight_input: bool = False):
    """main(x[m, k]) = relu(x @ W + b) with W a constant ([n, k] where
    `transposed`; a second input where `weight_input`), fused as the
    optimize stage fuses it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype("float32")
    b = rng.standard_normal(n).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([m, k], "float32"))
    wv = relax.Var("w", relax.TensorType(list(w.shape), "float32"))
    with bb.function("main", [x, wv] if weight_input else [x]):
        with bb.dataflow():
            weight = wv if weight_input else relax.const(w)

            def f(x_, w_, b_):
                y = topi.nn.dense(x_, w_) if transposed else topi.matmul(x_, w_)
                y = topi.add(y, b_)
                return topi.nn.relu(y) if relu else y

            out = bb.emit_output(bb.emit_te(f, x, weight, relax.const(b)))
        bb.emit_func_output(out)
    T = relax.transform
    mod = tvm.transform.Sequential([T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR(), T.DeadCodeElimination()])(
        bb.get())
    return mod, w


def _packed(mod, target):
    T = relax.transform
    return tvm.transform.Sequential([pack_weights.pack_gemm_weights(target), fold_weights.fold_weights(),
                                     T.FoldConstant(), T.DeadCodeElimination()])(mod)


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _constant_shapes(mod) -> list[list[int]]:
    out = []

    def visit(expr):
        value = getattr(expr, "value", None)
        if hasattr(value, "numpy"):
            out.append(list(value.numpy().shape))

    relax.analysis.post_order_visit(mod["main"], visit)
    return out


def _run(mod, target, *args):
    with target:
        ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tensor(a, tvm.cpu()) for a in args]).numpy()


@pytest.mark.parametrize("m,k,n,transposed,relu", [(5, 48, 64, False, True), (16, 40, 128, True, True),
                                                    (9, 32, 64, False, False)])
def test_a_dense_layer_is_packed_and_computes_the_same(llvm_target, m, k, n, transposed, relu):
    target = llvm_target.tvm_target()
    mod, _ = _dense(m, k, n, transposed, relu)
    packed = _packed(mod, target)
    (kernel,) = _kernels(packed).values()
    width = int(kernel.attrs[pack_weights.ATTR])
    # the weight folded into panels of the tile's width, read there by the kernel
    assert [n // width, k, width] in _constant_shapes(packed)
    assert [[int(d) for d in p.shape] for p in kernel.params][1] == [n // width, k, width]
    assert "layout_transform" not in packed["main"].script()
    x = np.random.default_rng(1).standard_normal((m, k)).astype("float32")
    np.testing.assert_allclose(_run(packed, target, x), _run(mod, target, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [197, 8, 1])
def test_the_default_schedule_takes_the_packed_kernel(llvm_target, m):
    """Ragged rows (ViT's 197 tokens) padded by pad_einsum as before
    packing; the tile vectorized along the panel."""
    target = llvm_target.tvm_target()
    mod, _ = _dense(m, 64, 96 if m == 8 else 64, relu=True)
    (kernel,) = _kernels(_packed(mod, target)).values()
    script = _check(kernel.with_attr("global_symbol", "k"), llvm_target).mod.script()
    assert "T.vectorized" in script
    # bias + ReLU at write-back, over the panels: the product is never stored outside the tile's registers
    assert "T_matmul = T.sblock_alloc_buffer" not in script and "T_matmul_local = T.sblock_alloc_buffer" in script


@pytest.mark.parametrize("rows,dim", [(12, 48), (197, 48), (197, 128)])
def test_a_batch_of_one_keeps_its_epilogue_in_the_tile(llvm_target, rows, dim):
    """A transformer's dense layer, [1, tokens, dim] x [dim, out] + bias +
    GELU-like epilogue: its blocks do not iterate the unit batch axis, and
    the chain is still laid out over the panels and applied at write-back
    (197 tokens over 128 products: the rows padded, cropped after the tiles
    instead)."""
    target = llvm_target.tvm_target()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((dim, 64)).astype("float32")
    b = rng.standard_normal(64).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, rows, dim], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            def dense(a, wt, bias):
                k = te.reduce_axis((0, dim), "k")
                y = te.compute((1, rows, 64), lambda i, j, n: te.sum(a[i, j, k] * wt[k, n], axis=k), name="matmul")
                return topi.multiply(topi.add(y, bias), topi.sigmoid(topi.add(y, bias)))

            out = bb.emit_output(bb.emit_te(dense, x, relax.const(w), relax.const(b)))
        bb.emit_func_output(out)
    T = relax.transform
    mod = tvm.transform.Sequential([T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR()])(bb.get())
    packed = _packed(mod, target)
    (kernel,) = _kernels(packed).values()
    assert pack_weights.ATTR in (kernel.attrs or {})
    script = _check(kernel.with_attr("global_symbol", "k"), llvm_target).mod.script()
    if dim == 128:
        assert "matmul_pad" in script
    else:  # the product is never stored outside the tile's registers
        assert "matmul = T.sblock_alloc_buffer" not in script and "matmul_local" in script
    xv = rng.standard_normal((1, rows, dim)).astype("float32")
    np.testing.assert_allclose(_run(packed, target, xv), _run(mod, target, xv), rtol=1e-5, atol=1e-5)


def test_a_product_written_out_directly_is_packed(llvm_target):
    """No epilogue: the product's own buffer staged (reindex), so that its
    layout can follow the panels."""
    target = llvm_target.tvm_target()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 64)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([1, 12, 48], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            def matmul(a, b):  # ViT's QKV projection: [1, tokens, dim] x [dim, 3 dim], nothing after it
                k = te.reduce_axis((0, 48), "k")
                return te.compute((1, 12, 64), lambda i, j, n: te.sum(a[i, j, k] * b[k, n], axis=k), name="matmul")

            out = bb.emit_output(bb.emit_te(matmul, x, relax.const(w)))
        bb.emit_func_output(out)
    T = relax.transform
    mod = tvm.transform.Sequential([T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR()])(bb.get())
    packed = _packed(mod, target)
    assert any(pack_weights.ATTR in (f.attrs or {}) for f in _kernels(packed).values())
    xv = rng.standard_normal((1, 12, 48)).astype("float32")
    np.testing.assert_allclose(_run(packed, target, xv), _run(mod, target, xv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["weight_input", "ragged_columns", "off"])
def test_left_as_it_is(llvm_target, monkeypatch, case):
    """A weight that is not a constant, columns no tile width divides (36:
    neither AVX-512's 16 lanes nor AVX2's 8), and PACK = False."""
    target = llvm_target.tvm_target()
    if case == "off":
        monkeypatch.setattr(pack_weights, "PACK", False)
    mod, _ = _dense(7, 32, 36 if case == "ragged_columns" else 64, weight_input=case == "weight_input")
    out = pack_weights.pack_gemm_weights(target)(mod)
    assert tvm_ffi.structural_equal(out, mod)


def test_a_kernel_shared_with_a_call_whose_weight_is_not_constant_is_left_alone(llvm_target):
    target = llvm_target.tvm_target()
    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([4, 32], "float32"))
    wv = relax.Var("w", relax.TensorType([32, 64], "float32"))
    a = te.placeholder((4, 32), name="a")
    b = te.placeholder((32, 64), name="b")
    func = te.create_prim_func([a, b, topi.matmul(a, b)])
    with bb.function("main", [x, wv]):
        gv = bb.add_func(func, "mm")
        with bb.dataflow():
            y = bb.emit(relax.call_tir(gv, (x, relax.const(rng.standard_normal((32, 64)).astype("float32"))),
                                       relax.TensorType([4, 64], "float32")))
            z = bb.emit(relax.call_tir(gv, (x, wv), relax.TensorType([4, 64], "float32")))
            out = bb.emit_output(relax.op.add(y, z))
        bb.emit_func_output(out)
    mod = bb.get()
    assert pack_weights.pack_prim_func(func, target) is not None  # the kernel alone would be packed
    assert tvm_ffi.structural_equal(pack_weights.pack_gemm_weights(target)(mod), mod)
