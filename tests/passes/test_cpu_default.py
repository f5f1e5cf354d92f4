"""deploy/passes/cpu_default.py: the default CPU schedule of contractions
computes what TVM's own lowering computes, on shapes that divide and shapes
that do not, and stays out of what it does not fit."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import te, topi

from deploy.build import build_kernel
from deploy.passes import cpu_default, schedule
from deploy.passes.cpu_default import ContractionTiling, InjectiveParallel
from deploy.tvm_compat import ms, tensor, tvm


def _run(func, llvm_target, args, outputs: int = 1):
    """The kernel's last `outputs` arguments after a run (one: that array)."""
    lib = build_kernel("k", func, llvm_target)
    arrays = [tensor(a, tvm.cpu()) for a in args]
    lib["k"](*arrays)
    got = [a.numpy() for a in arrays[-outputs:]]
    return got[0] if outputs == 1 else got


def _check(func, llvm_target, rule=ContractionTiling):
    """The rule applies, and its kernel's output equals the unscheduled one."""
    sch = rule().apply(func, llvm_target.tvm_target(), False)
    assert sch is not None
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in a.shape]).astype(str(a.dtype))
            for a in ms.arg_info.ArgInfo.from_prim_func(func)]
    want = _run(func, llvm_target, [a.copy() for a in args])
    got = _run(sch.mod["main"].with_attr("tirx.is_scheduled", True), llvm_target, [a.copy() for a in args])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return sch


@pytest.mark.parametrize("size,channels", [(10, 16), (7, 12), (5, 3)])
def test_conv_bias_relu_nchw(llvm_target, size, channels):
    x = te.placeholder((1, 8, size, size), name="x")
    w = te.placeholder((channels, 8, 3, 3), name="w")
    b = te.placeholder((1, channels, 1, 1), name="b")
    y = topi.nn.relu(topi.add(topi.nn.conv2d_nchw(x, w, 1, 1, 1), b))
    sch = _check(te.create_prim_func([x, w, b, y]), llvm_target)
    assert "T.vectorized" in sch.mod.script()
    # in parallel when there is enough work (115,200 multiply-adds at 10x10x16), on the caller's thread if not
    assert ("T.parallel" in sch.mod.script()) == (size * size * channels * 8 * 9 >= cpu_default.PARALLEL_MIN_WORK)


@pytest.mark.parametrize("m,n,k", [(64, 48, 32), (7, 33, 20), (1, 5, 3), (197, 197, 64), (197, 384, 40)])
def test_matmul(llvm_target, m, n, k):
    a = te.placeholder((m, k), name="a")
    b = te.placeholder((k, n), name="b")
    _check(te.create_prim_func([a, b, topi.matmul(a, b)]), llvm_target)


def test_nhwc_depthwise(llvm_target):
    x = te.placeholder((1, 9, 9, 24), name="x")
    w = te.placeholder((3, 3, 24, 1), name="w")
    y = topi.nn.depthwise_conv2d_nhwc(x, w, 1, 1, 1)
    _check(te.create_prim_func([x, w, y]), llvm_target)


@pytest.mark.parametrize("size,kernel,stride", [(14, 3, 1), (15, 3, 2), (9, 5, 1)])
def test_a_depthwise_convolution_reads_its_padding_in_place(llvm_target, monkeypatch, size, kernel, stride):
    """NCHW16c depthwise convolutions (MobileNet's 3x3 at strides 1 and 2,
    EfficientNet's 5x5) read their padding where they use it, as a pooling
    does, instead of a padded copy of the input at the root (WINDOW_PADDING:
    MobileNetV2's 0.21-0.79x the time); the result as TVM's own."""
    x = te.placeholder((1, 3, size, size, 16), name="x")
    w = te.placeholder((3, 1, kernel, kernel, 1, 16), name="w")
    p = kernel // 2
    pad = topi.nn.pad(x, (0, 0, p, p, 0), (0, 0, p, p, 0))
    rh, rw = te.reduce_axis((0, kernel), "rh"), te.reduce_axis((0, kernel), "rw")
    out = (size + 2 * p - kernel) // stride + 1
    y = te.compute((1, 3, out, out, 16), lambda n, c, i, j, b: te.sum(
        pad[n, c, i * stride + rh, j * stride + rw, b] * w[c, 0, rh, rw, 0, b], axis=[rh, rw]))
    func = te.create_prim_func([x, w, y])

    assert 'T.sblock("PadInput")' not in _check(func, llvm_target).mod.script()  # read through its condition
    monkeypatch.setattr(cpu_default, "WINDOW_PADDING", False)
    assert 'T.sblock("PadInput")' in _check(func, llvm_target).mod.script()  # a padded copy at the root


def test_leaves_what_it_does_not_fit(llvm_target):
    t = llvm_target.tvm_target()
    x = te.placeholder((4, 32), name="x")
    softmax = te.create_prim_func([x, topi.nn.softmax(x)])  # two reductions
    pool = te.create_prim_func([x, topi.sum(x, axis=1)])  # one operand
    relu = te.create_prim_func([x, topi.nn.relu(x)])  # no reduction
    assert all(ContractionTiling().apply(f, t, False) is None for f in (softmax, pool, relu))


def _multiply_vectorized(sch) -> bool:
    """Whether the multiply's innermost loop is a vector loop."""
    lines = sch.mod.script().splitlines()
    at = next(i for i, ln in enumerate(lines) if 'T.sblock("T_multiply' in ln)
    return "T.vectorized" in lines[at - 1]


def test_squeeze_excitation_broadcast_epilogue(llvm_target, monkeypatch):
    """EfficientNet's SE expansion: a 1x1 convolution on a 1x1 input, then a
    multiply broadcast over the block's 7x7 feature map. The multiply, left
    after the tiles, is left to LLVM over rows of 7; in NCHW16c it runs on
    whole vectors (left to LLVM it stayed scalar: MobileNetV3's such kernels
    4-12x slower, results/cpu/2026-12-07/vector-epilogue/)."""
    x = te.placeholder((1, 48, 1, 1), name="x")
    w = te.placeholder((1152, 48, 1, 1), name="w")
    b = te.placeholder((1, 1152, 1, 1), name="b")
    y = te.placeholder((1, 1152, 7, 7), name="y")
    out = topi.multiply(y, topi.sigmoid(topi.add(topi.nn.conv2d_nchw(x, w, 1, 0, 1), b)))
    assert not _multiply_vectorized(_check(te.create_prim_func([x, w, b, y, out]), llvm_target))  # (rows of 7)
    xc = te.placeholder((1, 3, 1, 1, 16), name="x")
    wc = te.placeholder((72, 3, 1, 1, 16, 16), name="w")
    yc = te.placeholder((1, 72, 7, 7, 16), name="y")
    with llvm_target.tvm_target():  # (TOPI's NCHWc convolution asks for one)
        conv = topi.nn.conv2d_NCHWc(xc, wc, (1, 1), (0, 0), (1, 1), "NCHW16c", "NCHW16c", "float32")
    func = te.create_prim_func([xc, wc, yc, topi.multiply(yc, topi.sigmoid(conv))])
    assert _multiply_vectorized(_check(func, llvm_target))
    monkeypatch.setattr(cpu_default, "VECTOR_EPILOGUE", False)
    assert not _multiply_vectorized(_check(func, llvm_target))


GEMV_SE_KERNEL = """
import sys
from tvm import te, topi
from deploy.tvm_compat import tvm, Target, dlight
x = te.placeholder((1, 48, 1, 1), name="x"); w = te.placeholder((1152, 48, 1, 1), name="w")
b = te.placeholder((1, 1152, 1, 1), name="b"); y = te.placeholder((1, 1152, 7, 7), name="y")
f = te.create_prim_func([x, w, b, y, topi.multiply(y, topi.sigmoid(topi.add(topi.nn.conv2d_nchw(x, w, 1, 0, 1), b)))])
t = Target({"kind": "llvm", "mcpu": "x86-64-v4", "num-cores": 2})
with t:
    s = dlight.cpu.GEMV().apply(f, t, False)
print("scheduled" if s is not None else "not applied", flush=True)
if s is not None:
    with tvm.transform.PassContext(opt_level=3):
        tvm.tirx.build(tvm.IRModule({"main": s.mod["main"].with_attr("global_symbol", "main")}), target=t)
    print("built", flush=True)
"""


def test_dlight_gemv_still_does_not_compile_a_squeeze_excitation_kernel():
    """Fails once TVM compiles DLight GEMV's schedule of EfficientNet's SE
    kernel within 30 s of scheduling it (it ran for minutes): then GEMV may
    come back into the CPU chain, after ours."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", GEMV_SE_KERNEL], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "scheduled"  # imports done, the schedule made: now the build
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=30)
    finally:
        child.kill()
        child.wait()


def test_a_reduction_of_extent_one_is_left_alone(llvm_target):
    a = te.placeholder((8, 1), name="a")
    b = te.placeholder((1, 16), name="b")
    assert ContractionTiling().apply(te.create_prim_func([a, b, topi.matmul(a, b)]), llvm_target.tvm_target()) is None


@pytest.mark.parametrize("shape", [(2, 64, 56, 56), (1, 7, 5), (3,)])
def test_injective_kernels_run_in_parallel_and_compute_the_same(llvm_target, shape):
    x = te.placeholder(shape, name="x")
    y = te.placeholder(shape[-1:], name="y")
    gelu = topi.multiply(topi.add(x, y), topi.sigmoid(x))  # broadcast, elementwise
    sch = _check(te.create_prim_func([x, y, gelu]), llvm_target, InjectiveParallel)
    if len(shape) == 4:
        assert "T.parallel" in sch.mod.script() and "T.vectorized" in sch.mod.script()


def test_an_elementwise_chain_through_reshapes_is_one_loop_nest(llvm_target):
    """ConvNeXt's GELU as the frontend fuses it: divide, reshape, erf, add,
    reshape, multiply, multiply. Each block used to run at the root, writing
    its intermediate and, behind the reshapes' index arithmetic, unvectorized;
    inlined, the chain is one parallel, vectorized loop nest."""
    from deploy.tvm_compat import dlight

    x = te.placeholder((196, 96), name="x")
    r = topi.reshape(topi.divide(x, 1.4142135), (1, 14, 14, 96))
    y = topi.multiply(topi.multiply(x, topi.reshape(topi.add(topi.erf(r), 1.0), (196, 96))), 0.5)
    sch = _check(te.create_prim_func([x, y]), llvm_target, InjectiveParallel)
    assert len(sch.get_child_blocks(dlight.analysis.get_root_block(sch))) == 1
    assert "T.parallel" in sch.mod.script() and "T.vectorized" in sch.mod.script()


def test_injective_layout_changes_pad_and_concat(llvm_target):
    x = te.placeholder((1, 24, 10, 10), name="x")
    y = te.placeholder((1, 8, 10, 10), name="y")
    for out in (topi.transpose(x, (0, 2, 3, 1)), topi.nn.pad(x, (0, 0, 1, 1), (0, 0, 1, 1)),
                topi.concatenate([x, y], axis=1)):
        args = [x, y] if out.op.name.startswith("concat") or len(out.op.input_tensors) == 2 else [x]
        _check(te.create_prim_func([*args, out]), llvm_target, InjectiveParallel)


def _layout_change(shape, index_map):
    """Relax's layout_transform as the frontend legalizes it: a block over
    the input's domain, written through the index map."""
    from deploy.tvm_compat import relax, tirx

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.layout_transform(x, index_map=index_map))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    return next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc))


def _writes_along_the_vector(sch) -> bool:
    """Whether the kernel's one block's vectorized loop indexes its output's
    last axis (its vector stores contiguous)."""
    from deploy.passes.kernel_shape import vars_of
    from deploy.tvm_compat import dlight

    (block,) = sch.get_child_blocks(dlight.analysis.get_root_block(sch))
    loops = sch.get_loops(block)
    stmt, realize = sch.get(block), sch.get(loops[-1]).body
    assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED
    bound = dict(zip((iv.var for iv in stmt.iter_vars), realize.iter_values))
    last = stmt.writes[0].region[-1].min
    used = set().union(*(vars_of(bound[v]) for v in bound if v in vars_of(last)))
    return sch.get(loops[-1]).loop_var in used


@pytest.mark.parametrize("shape,index_map", [
    ((1, 2, 6, 20, 16), lambda n, c, h, w, b: (n, c * 16 + b, h, w)),  # NCHW16c -> NCHW
    ((1, 32, 6, 20), lambda n, c, h, w: (n, c // 16, h, w, c % 16)),  # NCHW -> NCHW16c: c split by 16
    ((1, 16, 6, 20), lambda n, c, h, w: (n, c // 16, h, w, c % 16)),  # one block of 16: c itself
])
def test_layout_changes_write_whole_vectors(llvm_target, monkeypatch, shape, index_map):
    """A layout change iterates over its input; its vector ran along the
    input's last axis, so its stores scattered (NCHW16c to NCHW: 16 planes
    apart). The loop along the output's last axis goes innermost instead, the
    reads gathering: U-Net's layout changes 2-12x faster."""
    func = _layout_change(shape, index_map)
    sch = _check(func, llvm_target, InjectiveParallel)
    assert _writes_along_the_vector(sch)
    monkeypatch.setattr(cpu_default, "CONTIGUOUS_WRITES", False)
    assert not _writes_along_the_vector(_check(func, llvm_target, InjectiveParallel))


def test_injective_rule_leaves_reductions_alone(llvm_target):
    x = te.placeholder((4, 32), name="x")
    assert InjectiveParallel().apply(te.create_prim_func([x, topi.sum(x, axis=1)]), llvm_target.tvm_target()) is None


def test_the_cpu_chain_has_no_gemv():
    names = [n for n, _ in schedule.rules("llvm")]
    assert names == [schedule.CONTRACTION, schedule.STATISTICS, "dlight.Reduction", schedule.INJECTIVE]
    assert schedule.CONTRACTION not in [n for n, _ in schedule.rules("cuda")]


def test_blocked_layout_conv_holds_a_two_axis_tile_in_registers(llvm_target):
    """NCHW16c: output channels in the vector, a row of output pixels and
    (on AVX-512) a second block of output channels held in registers (both
    loops unrolled): 14 accumulators of 16 lanes."""
    x = te.placeholder((1, 4, 14, 14, 16), name="x")
    w = te.placeholder((4, 4, 3, 3, 16, 16), name="w")
    with llvm_target.tvm_target():
        y = topi.nn.conv2d_NCHWc(x, w, 1, 1, 1, "NCHW16c", "NCHW16c", "float32")
    sch = _check(te.create_prim_func([x, w, y]), llvm_target)
    script = sch.mod.script()
    # 7 pixels of a row (its largest divisor up to 8) x 2 blocks of 16 channels: 14 accumulators of 16 lanes
    from deploy.tvm_compat import target_codegen

    lanes = target_codegen.llvm_get_vector_width(llvm_target.tvm_target()) // 32
    assert "T.unroll(7)" in script and "T.vectorized(16)" in script
    # AVX-512: one vector of 16 channels by 2 outer channel blocks; AVX2: the 16 channels are two vectors already
    assert ("T.unroll(2)" in script) == (lanes >= 16)


def test_a_batch_of_one_keeps_its_epilogue_in_the_tile(llvm_target):
    """NCHW16c at batch 1 with bias and ReLU: the epilogue's loops leave out
    the unit batch axis, and it is still applied as each tile is written
    back, not in a second pass over the output (c0ad16f's comparison of its
    loops with the product's shape missed that: MobileNetV2 1.56x -> 2.04x
    ONNX Runtime's time)."""
    x = te.placeholder((1, 2, 8, 8, 16), name="x")
    w = te.placeholder((2, 2, 3, 3, 16, 16), name="w")
    b = te.placeholder((1, 2, 1, 1, 16), name="b")
    with llvm_target.tvm_target():
        y = topi.nn.relu(topi.add(topi.nn.conv2d_NCHWc(x, w, 1, 1, 1, "NCHW16c", "NCHW16c", "float32"), b))
    script = _check(te.create_prim_func([x, w, b, y]), llvm_target).mod.script()
    # the product is never stored outside the tile's registers: no pass of its own for the epilogue
    assert "conv2d_NCHWc = T.sblock_alloc_buffer" not in script and "conv2d_NCHWc_local" in script


def test_an_epilogue_that_transposes_a_square_product_computes_right(llvm_target):
    """Its loops cover the product's shape but read it transposed: inlined
    at write-back where TVM can, after the tiles where not; right either way."""
    a = te.placeholder((64, 64), name="a")
    b = te.placeholder((64, 64), name="b")
    _check(te.create_prim_func([a, b, topi.transpose(topi.matmul(a, b), [1, 0])]), llvm_target)


def test_batch_matmul_blocks_no_axis_both_operands_index(llvm_target):
    """Attention's [heads, 197, 64] x [heads, 64, 197]: the heads are indexed
    by both operands, so blocking them would reuse nothing: rows only."""
    a = te.placeholder((4, 197, 64), name="a")
    b = te.placeholder((4, 64, 197), name="b")
    sch = _check(te.create_prim_func([a, b, topi.nn.batch_matmul(a, b, transpose_b=False)]), llvm_target)
    script = sch.mod.script()
    # no second blocked axis: the rows take every accumulator (16 of one vector each)
    assert "T.unroll(16)" in script and "T.unroll(2)" not in script and "T.unroll(4)" not in script


def test_a_row_no_small_block_divides_is_blocked_whole(llvm_target, monkeypatch):
    """SqueezeNet's 13 x 13 convolutions: 8 pixels of a row and a predicated
    5 kept the accumulators out of registers (its classifier, 512 -> 1000
    channels, 2.09 ms); 13 pixels a tile, no predicate: 0.99 ms. Where there
    is no second blocked axis, a row takes up to every accumulator (55
    pixels: 11, not 5), also where a second block would leave its last tile
    mostly empty (7 blocks by 2).
    WHOLE_BLOCKS = False keeps the old tiles."""
    def nchw16c_1x1(size, out_blocks):
        x = te.placeholder((1, 2, size, size, 16), name="x")
        w = te.placeholder((out_blocks, 2, 1, 1, 16, 16), name="w")
        with llvm_target.tvm_target():
            return te.create_prim_func([x, w, topi.nn.conv2d_NCHWc(x, w, 1, 0, 1, "NCHW16c", "NCHW16c", "float32")])

    rows13 = nchw16c_1x1(13, 3)
    script = _check(rows13, llvm_target).mod.script()
    assert "T.unroll(13)" in script and "T.where" not in script
    x2 = te.placeholder((1, 55, 55, 16), name="x2")
    w2 = te.placeholder((16, 16), name="w2")
    k = te.reduce_axis((0, 16), name="k")
    rows = te.compute((55, 55, 16), lambda h, i, j: te.sum(x2[0, h, i, k] * w2[k, j], axis=k), name="rows")
    assert "T.unroll(11)" in _check(te.create_prim_func([x2, w2, rows]), llvm_target).mod.script()
    # EfficientNet's projections: 7 blocks of output channels, by 2 a predicated 2 + 2 + 2 + 1; now not blocked,
    # the 14 pixels of a row taking the accumulators
    blocks7 = nchw16c_1x1(14, 7)
    script = _check(blocks7, llvm_target).mod.script()
    assert "T.unroll(14)" in script and "T.where" not in script
    monkeypatch.setattr(cpu_default, "WHOLE_BLOCKS", False)
    assert "T.where" in _check(rows13, llvm_target).mod.script()
    assert "T.where" in _check(blocks7, llvm_target).mod.script()


def test_a_tile_its_axes_do_not_divide_is_padded_not_predicated(llvm_target, monkeypatch):
    """Attention's scores, 197 keys along the vector: a tile cut short by a
    predicate keeps LLVM from vectorizing it (ViT's ran at 10 GFLOP/s), so
    the operands are padded to whole tiles and the result cropped; the
    numbers are the unscheduled kernel's (`_check`). PAD = False keeps the
    predicated tile (the A/B switch)."""
    a = te.placeholder((4, 197, 64), name="a")
    b = te.placeholder((4, 64, 197), name="b")
    func = te.create_prim_func([a, b, topi.nn.batch_matmul(a, b, transpose_b=False)])
    script = _check(func, llvm_target).mod.script()
    # the keys (the vector) padded; the rows, 64 products an output, left to their predicate
    assert "b_pad" in script and "a_pad" not in script
    k = te.reduce_axis((0, 256), name="k")
    a2 = te.placeholder((4, 197, 256), name="a2")
    b2 = te.placeholder((4, 256, 197), name="b2")
    wide = te.compute((4, 197, 197), lambda n, i, j: te.sum(a2[n, i, k] * b2[n, k, j], axis=k), name="wide")
    script = _check(te.create_prim_func([a2, b2, wide]), llvm_target).mod.script()
    assert "a2_pad" in script and "b2_pad" in script and "T.where" not in script  # 256 products: rows too
    monkeypatch.setattr(cpu_default, "PAD", False)
    assert "b_pad" not in (script := _check(func, llvm_target).mod.script()) and "T.where" in script


def test_a_padded_kernel_keeps_its_epilogue_whatever_the_epilogues_shape(llvm_target):
    """Padded, the result reaches its consumers through the crop: a bias and
    ReLU, and a concatenation whose output happens to have the padded shape
    (11 columns before 197: 208), which inlining into the tile would refuse."""
    x = te.placeholder((64, 64), name="x")
    w = te.placeholder((64, 197), name="w")
    bias = te.placeholder((197,), name="bias")
    mm = topi.matmul(x, w)
    script = _check(te.create_prim_func([x, w, bias, topi.nn.relu(topi.add(mm, bias))]), llvm_target).mod.script()
    assert "w_pad" in script and "T.where" not in script
    d = te.placeholder((64, 11), name="d")
    script = _check(te.create_prim_func([x, w, d, topi.concatenate([d, mm], axis=1)]), llvm_target).mod.script()
    assert "w_pad" in script


def test_padding_only_where_it_pays_and_cannot_fault(llvm_target):
    """Nine rows would be padded to 16 (78% more work; it measured slower):
    left to their predicate, as are output channels of a convolution that
    sums few products. An integer division by an operand would divide by the
    padded zeros: not padded either."""
    a = te.placeholder((9, 64), name="a")
    b = te.placeholder((64, 512), name="b")
    script = _check(te.create_prim_func([a, b, topi.matmul(a, b)]), llvm_target).mod.script()
    assert "_pad" not in script and "T.where" in script
    # ShuffleNet's 1x1 convolution, 24 -> 58 channels: 58 to 64 wastes little, but 24 products an output do
    # not pay for the copies (0.74x)
    x = te.placeholder((1, 24, 28, 28), name="x")
    w = te.placeholder((58, 24, 1, 1), name="w")
    script = _check(te.create_prim_func([x, w, topi.nn.conv2d_nchw(x, w, 1, 0, 1)]), llvm_target).mod.script()
    assert "w_pad" not in script
    x = te.placeholder((16, 8), name="x", dtype="int32")
    y = te.placeholder((8, 197), name="y", dtype="int32")
    k = te.reduce_axis((0, 8), name="k")
    div = te.compute((16, 197), lambda i, j: te.sum(tvm.tirx.truncdiv(x[i, k], y[k, j]), axis=k), name="div")
    func = te.create_prim_func([x, y, div])
    sch = ContractionTiling().apply(func, llvm_target.tvm_target(), False)
    assert sch is not None and "y_pad" not in sch.mod.script()


def _equal_not_cast():
    """RoBERTa's padding mask before its CumSum: Equal, Not, Cast, each its
    own block over bool intermediates (as FuseTIR leaves them)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((T.int64(2), T.int64(16)), "int64"), y: T.Buffer((T.int64(2), T.int64(16)), "int32"),
             z: T.Buffer((T.int64(2), T.int64(16)), "int64")):
        T.func_attr({"tirx.noalias": True})
        e = T.sblock_alloc_buffer((T.int64(2), T.int64(16)), "bool")
        n = T.sblock_alloc_buffer((T.int64(2), T.int64(16)), "bool")
        for i, j in T.grid(T.int64(2), T.int64(16)):
            with T.sblock("eq"):
                vi, vj = T.axis.remap("SS", [i, j])
                e[vi, vj] = x[vi, vj] == T.int64(1)
        for i, j in T.grid(T.int64(2), T.int64(16)):
            with T.sblock("not"):
                vi, vj = T.axis.remap("SS", [i, j])
                n[vi, vj] = not e[vi, vj]
        for i, j in T.grid(T.int64(2), T.int64(16)):
            with T.sblock("cast"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.Cast("int32", n[vi, vj])
        for i, j in T.grid(T.int64(2), T.int64(16)):
            with T.sblock("twice"):
                vi, vj = T.axis.remap("SS", [i, j])
                z[vi, vj] = x[vi, vj] * T.int64(2)

    return main


_PADDED_IDS = np.array([[8, 6, 5, 2, 3, 0, 0, 0, 1, 8, 1, 1, 4, 1, 9, 1]] * 2, "int64")


def _masked(func, llvm_target):
    mask, twice = _run(func, llvm_target, [_PADDED_IDS, np.zeros(_PADDED_IDS.shape, "int32"),
                                           np.zeros(_PADDED_IDS.shape, "int64")], outputs=2)
    np.testing.assert_array_equal(twice, _PADDED_IDS * 2)
    return mask


def test_bool_intermediates_stay_scalar_and_compute_the_mask(llvm_target):
    sch = InjectiveParallel().apply(_equal_not_cast(), llvm_target.tvm_target(), False)
    got = _masked(sch.mod["main"].with_attr("tirx.is_scheduled", True), llvm_target)
    np.testing.assert_array_equal(got, (_PADDED_IDS != 1).astype("int32"))
    assert sch.mod.script().count("T.vectorized") == 1  # the block without bool ("twice") still is


def test_tvm_still_miscompiles_vectorized_bool_intermediates(llvm_target):
    """The defect `cpu_default._touches_bool` works around: fails once TVM's
    LLVM codegen computes Not over a vectorized bool buffer right."""
    from deploy.tvm_compat import s_tir

    sch = s_tir.Schedule(_equal_not_cast())
    for name in ("eq", "not", "cast", "twice"):
        sch.vectorize(sch.get_loops(sch.get_sblock(name))[-1])
    got = _masked(sch.mod["main"].with_attr("tirx.is_scheduled", True), llvm_target)
    assert not np.array_equal(got, (_PADDED_IDS != 1).astype("int32"))
    assert set(np.unique(got)) <= {-2, -1, 0, 1}


@pytest.mark.parametrize("size, pool, stride, padding, ceil", [(111, 3, 2, (0, 0, 0, 0), True), (56, 3, 1, (1, 1, 1, 1), False),
                                                               (56, 2, 2, (0, 0, 0, 0), False)])
def test_a_max_pooling_is_tiled_on_vectors_its_padding_read_in_place(llvm_target, monkeypatch, size, pool, stride,
                                                                     padding, ceil):
    """NCHW16c max pools (SqueezeNet's 3x3 / 2 in ceil mode, a 3x3 / 1 padded,
    UNet's 2x2): tiled on 16-channel vectors and run in parallel, the padding
    read where it is used rather than copied first, the result as TVM's own;
    with POOLS off the rule leaves them to TVM's plain lowering."""
    x = te.placeholder((1, 4, size, size, 16), name="x")
    func = te.create_prim_func([x, topi.nn.pool2d(x, (pool, pool), (stride, stride), (1, 1), padding, "max", ceil,
                                                  layout="NCHW16c")])
    script = _check(func, llvm_target).mod.script()
    assert "T.parallel" in script and "T.vectorized" in script
    assert "pad_temp" not in script  # (no copy of the input: read through the padding's condition)
    monkeypatch.setattr(cpu_default, "POOLS", False)
    assert ContractionTiling().apply(func, llvm_target.tvm_target(), False) is None
