"""deploy/passes/pad_gemm.py: GEMM rows that tile badly padded to a multiple
of 128 inside the kernel. The padded kernel computes the same, pads only
where meant, stays one kernel under MetaSchedule's tensor-core schedules,
and the workaround is still needed (MetaSchedule's design space tiles
6,304 rows only in blocks that divide them)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deploy import config
from deploy.optimize import phases
from deploy.passes import pad_gemm
from deploy.passes.flat_gemm import flat_epilogues
from deploy.tvm_compat import relax, tirx, tvm

from . import fp16_gemm


def _gemm(m: int, n: int, k: int):
    """fp16 GEMM with an fp32 sum, cast back, plus a bias: a fused dense layer."""
    return fp16_gemm(m, n, k, "bias", name="matmul")["main"]


def _buffers(func) -> list[tuple[int, ...]]:
    """The shapes of the buffers the function allocates."""
    import re

    return [tuple(int(d) for d in re.findall(r"\d+", m)) for m in re.findall(r"sblock_alloc_buffer\(\(([^)]*)\)", func.script())]


@pytest.mark.parametrize(("extents", "roles", "expected"), [
    ([6304, 1536, 384], ["m", "n", "k"], [128, 1, 1]),  # ViT-S/16 at batch 32
    ([4096, 1024, 256], ["m", "n", "k"], None),  # a multiple of 64: tiles as it is
    ([197, 384, 384], ["m", "n", "k"], None),  # batch 1: too few rows to be worth it
    ([32, 1000, 384], ["m", "n", "k"], None),  # a classifier's 1,000 columns
    ([2048, 1100, 64], ["m", "n", "k"], [1, 128, 1]),  # columns as well as rows
    ([32, 197, 384, 384], ["m", "m", "n", "k"], None),  # rows over two loops: DLight cannot write them back
    ([8, 1100, 1100, 64], ["b", "m", "n", "k"], [1, 128, 128, 1]),
])
def test_padding_for(extents, roles, expected):
    assert pad_gemm.padding_for(extents, roles) == expected


def test_padded_gemm_computes_the_same():
    m, n, k = 1100, 64, 32
    func = _gemm(m, n, k)
    padded = pad_gemm.pad_prim_func(func)
    assert padded is not None
    assert (1152, k) in _buffers(padded) and (1152, n) in _buffers(padded)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype("float16")
    b = rng.standard_normal((k, n)).astype("float16")
    bias = rng.standard_normal(n).astype("float16")
    outs = []
    for f in (func, padded):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        out = tvm.runtime.tensor(np.zeros((m, n), "float16"))
        lib["main"](*(tvm.runtime.tensor(x) for x in (a, b, bias)), out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    ref = (a.astype("float32") @ b.astype("float32")).astype("float16") + bias
    np.testing.assert_allclose(outs[1].astype("float32"), ref.astype("float32"), rtol=1e-2, atol=1e-2)


def test_left_alone():
    from tvm import te, topi

    assert pad_gemm.pad_prim_func(_gemm(2048, 256, 64)) is None  # tiles as it is
    data = te.placeholder((1, 1100, 1100, 8), "float16")
    weight = te.placeholder((3, 3, 8, 16), "float16")
    conv = topi.nn.conv2d_nhwc(data, weight, 1, 1, 1, out_dtype="float32")
    assert pad_gemm.pad_prim_func(te.create_prim_func([data, weight, conv])) is None  # windowed reads


def _sm90():
    from deploy import targets
    from deploy.tvm_compat import register_tensor_intrinsics

    register_tensor_intrinsics()
    return targets.resolve("cuda:sm_90").tvm_target()


def _row_tiles(func, target, seeds: int) -> list[list[int]]:
    """The row loop's tile decisions (16-row fragments per level) of the
    tensor-core design space, one per seed."""
    from deploy.tvm_compat import ms

    out = []
    for seed in range(1, seeds + 1):
        ctx = ms.TuneContext(mod=tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target,
                             rand_state=seed, space_generator="post-order-apply")
        sch = ctx.generate_design_space()[0]
        tiles = [list(map(int, d)) for inst, d in sch.trace.decisions.items() if inst.kind.name == "SamplePerfectTile"]
        out.append(tiles[0])
    return out


def test_still_needed_metaschedule_tiles_rows_by_divisors_only():
    """ViT-S/16's 6,304 rows are 394 = 2 x 197 fragments of 16: MetaSchedule
    draws row tiles whose product is exactly 394, so a thread block covers
    16, 32 or 3,152+ rows. Fails once it draws other tiles; the pass can go."""
    target = _sm90()
    for tiles in _row_tiles(_gemm(6304, 1536, 384), target, seeds=6):
        assert math.prod(tiles) == 394
        assert 197 in tiles or 394 in tiles
    padded = pad_gemm.pad_prim_func(_gemm(6304, 1536, 384))
    assert any(math.prod(t[1:]) >= 4 for t in _row_tiles(padded, target, seeds=6))  # 64+ rows a block


def test_padded_gemm_is_one_kernel_under_tensor_core_schedules():
    """The padding is read in the shared-memory load and the valid rows are
    written in the write-back: one CUDA kernel, with tensor cores."""
    from deploy.tuning import builder
    from deploy.tvm_compat import ms

    target = _sm90()
    mod = tvm.IRModule({"main": pad_gemm.pad_prim_func(_gemm(6304, 1536, 384)).with_attr("global_symbol", "main")})
    built = 0
    for seed in range(1, 40):
        ctx = ms.TuneContext(mod=mod, target=target, rand_state=seed, space_generator="post-order-apply")
        sch = ctx.generate_design_space()[0]
        if not all(p.apply(sch) for p in ctx.space_generator.postprocs):
            continue
        src = next(m for m in builder.lean_build(sch.mod, target, None).imports if m.kind == "cuda").inspect_source()
        import re

        assert len(set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", src))) == 1
        assert "wmma" in src
        built += 1
        if built == 2:
            break
    assert built


def _dense(rows: int):
    from tvm.script import ir as I
    from tvm.script import relax as R
    from tvm.script.parser import parse

    return parse(f"""
@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((32, {rows}, 64), "float16"), w: R.Tensor((64, 48), "float16"),
             r: R.Tensor((32, {rows}, 48), "float16")):
        with R.dataflow():
            y = R.matmul(x, w, out_dtype="float16")
            z = R.add(y, r)
            R.output(z)
        return z
""", extra_vars={"I": I, "R": R})


def _matmul_ranks(mod) -> list[int]:
    ranks = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.matmul":
            ranks.append(len(e.args[0].ty.shape))

    relax.analysis.post_order_visit(mod["main"], visit)
    return ranks


def test_flat_epilogues_makes_padded_rows_one_loop():
    assert _matmul_ranks(flat_epilogues(pad_rows=True)(_dense(197))) == [2]  # 6,304 rows: padded, so flattened
    assert _matmul_ranks(flat_epilogues(pad_rows=True)(_dense(64))) == [3]  # 2,048 rows: as it was
    assert _matmul_ranks(flat_epilogues()(_dense(197))) == [3]


def test_profiles():
    cuda = config.from_dict({"model": {"source": "resnet18"}}).cuda
    names = [type(p).__name__ if not hasattr(p, "info") else p.info.name
             for _, passes in phases(cuda) for p in passes]
    assert "PadGemmRows" in names
    llvm = config.from_dict({"model": {"source": "resnet18"}}).llvm
    assert "PadGemmRows" not in [p.info.name for _, passes in phases(llvm) for p in passes if hasattr(p, "info")]


def test_a_dense_layer_padded_through_fusion_computes_the_same():
    """[32, 197, 64] @ [64, 48] + residual, as the CUDA profile's optimize
    phases leave it (made 2-D, fused, rows padded inside the kernel: int64
    shapes, Relax's buffer names, an epilogue), built for the CPU."""
    from deploy.passes.pad_gemm import pad_gemm_rows
    from deploy.tvm_compat import PassContext, VirtualMachine, tensor

    T = relax.transform
    outs = []
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 197, 64)).astype("float16")
    w = rng.standard_normal((64, 48)).astype("float16")
    r = rng.standard_normal((32, 197, 48)).astype("float16")
    for pad in (False, True):
        with PassContext(opt_level=3):
            mod = tvm.ir.transform.Sequential([
                flat_epilogues(pad_rows=True), T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR(),
                T.DeadCodeElimination(), T.RewriteDataflowReshape(), *([pad_gemm_rows()] if pad else [])])(_dense(197))
        padded = [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and "_pad" in f.script()]
        assert len(padded) == int(pad)
        ex = tvm.compile(mod, target="llvm")
        outs.append(VirtualMachine(ex, tvm.cpu())["main"](tensor(x), tensor(w), tensor(r)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])  # the same arithmetic, element by element
    ref = (x.astype("float32") @ w.astype("float32")) + r.astype("float32")
    np.testing.assert_allclose(outs[1].astype("float32"), ref, rtol=0.05, atol=0.1)  # (an fp16 sum of 64 products)
