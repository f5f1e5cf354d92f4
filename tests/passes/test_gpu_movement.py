"""Our CUDA schedules of movement (passes/gpu_movement.py): transposes into
a short last axis (ShortInnerAxis) and through shared memory
(TiledTranspose); rows in 16-byte vectors (VectorRows)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploy import targets
from deploy.build import build_kernel
from deploy.passes import gpu_movement, schedule
from deploy.passes.gpu_movement import ShortInnerAxis, TiledTranspose, VectorRows
from deploy.tvm_compat import relax, tvm

from .test_gpu_default import _kernels
from .test_gpu_default import _reference as _plain


def _kernel(build, target, shape, dtype="float32"):
    """The one fused PrimFunc of a Relax function of one input built by `build(x)`."""
    (func,) = _kernels(lambda bb, x: build(x), target, shape, dtype).values()
    return func


def _nhwc(pad=0, dtype="float16"):
    """An image's NCHW input made NHWC and cast, `pad` channels of zeros
    after its own (3 + 5: the stem's implicit GEMM's input)."""
    def build(x):
        y = relax.op.astype(relax.op.permute_dims(x, [0, 2, 3, 1]), dtype)
        return relax.op.nn.pad(y, [0, 0, 0, 0, 0, 0, 0, pad]) if pad else y
    return build


def _reference(func):
    args, want = _plain(func)
    return args, want[-1].numpy()


def _check(rule, build, shape, dtype, on_gpu=False, kernel=None):
    """`rule`'s schedule of the kernel `build` makes (`kernel(build, target,
    shape, dtype)` picks it, `_kernel` by default), run in emulation (or on
    the GPU) against TVM's plain lowering of it for the CPU: equal bit for
    bit (both only move and cast), and in emulation no problem found (a
    shared-memory race, a read of an element never written). Returns the
    schedule."""
    info = targets.resolve("cuda:sm_90")
    target = info.tvm_target()
    func = (kernel or _kernel)(build, target, shape, dtype)
    args, want = _reference(func)
    with target:
        sch = rule().apply(func, target)
    assert sch is not None
    if on_gpu:
        lib = build_kernel("k", sch.mod["main"], info)
        got = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in args]
        lib["k"](*got)
        got, problems = got[-1].numpy(), set()
    else:
        from .. import emulation

        got, problems = emulation.run(func, sch.mod["main"], target, args)
    assert not problems, problems
    np.testing.assert_array_equal(got, want)
    return sch


def _blocked(n, h, w):
    """The stem's input blocked in 2 x 2 pixels (passes/implicit_gemm.space_to_depth):
    NHWC fp16, padded by 3 pixels and to 4 channels, [N, H/2, W/2, 16]."""
    def build(x):
        y = relax.op.nn.pad(_nhwc()(x), [0, 0, 3, 3, 3, 3, 0, 1])
        hp, wp = h + 6, w + 6
        y = relax.op.permute_dims(relax.op.reshape(y, (n, hp // 2, 2, wp // 2, 2, 4)), [0, 1, 3, 2, 4, 5])
        return relax.op.reshape(y, (n, hp // 2, wp // 2, 16))
    return build


CASES = [  # (what, build, input shape)
    ("3 channels padded to 8, fp16", _nhwc(5), (2, 3, 10, 12)),  # (240 rows: stored element by element)
    ("3 channels padded to 8, fp16, a vector a row", _nhwc(5), (1, 3, 16, 16)),  # (256 rows: 16-byte stores)
    ("3 channels, fp16", _nhwc(), (2, 3, 10, 12)),
    ("4 channels, fp32", _nhwc(dtype="float32"), (1, 4, 9, 7)),
    ("4 channels, fp32, a vector a row", _nhwc(dtype="float32"), (1, 4, 16, 16)),
    ("blocked in 2 x 2 pixels, 32-byte rows", _blocked(2, 10, 12), (2, 3, 10, 12)),  # (288 pieces: element by element)
    ("blocked in 2 x 2 pixels, 16-byte stores", _blocked(1, 26, 26), (1, 3, 26, 26)),  # (512 pieces of 16 bytes)
    ("8 channels, fp32, in two pieces", _nhwc(dtype="float32"), (2, 8, 16, 16)),
]


@pytest.mark.parametrize("what, build, shape", CASES, ids=[c[0] for c in CASES])
def test_a_transpose_into_a_short_last_axis_computes_what_tvms_plain_lowering_does(what, build, shape):
    """In emulation (tests/cuda_emu.py): a thread a pixel, every output
    element written once, the padding zero; odd sizes, so the last block
    is partly idle."""
    _check(ShortInnerAxis, build, shape, "float32")


def test_the_padded_input_is_read_once_a_channel_and_stored_16_bytes_at_once(sm90):
    """The CUDA of ResNet's input at batch 2: the 3 real channels loaded (the
    padding's condition folded by the unrolled row), one 16-byte store a
    thread, and the rule first in the chain to take the kernel."""
    from .. import emulation

    func = _kernel(_nhwc(5), sm90, (2, 3, 224, 224))
    gv = tvm.ir.GlobalVar("main")
    with sm90:
        name, sch = next(s for s in schedule._sources(gv, func, None, sm90, "cuda") if not isinstance(s[1], Exception))
    assert name == schedule.SHORT_INNER
    src = emulation.source(sch, sm90)
    body = src[src.index("main_kernel("):]
    assert body.count("x_ptr[") == 3 and body.count("*(uint4*)(") == 2, body  # (the store: both sides)
    assert emulation.launch(sch, sm90)[:2] == (2 * 224 * 224 // 256, (256, 1))


@pytest.mark.parametrize("what, build, shape", [
    ("no transpose: NHWC cast", lambda x: relax.op.astype(x, "float16"), (2, 8, 8, 8)),
    ("a long last axis", _nhwc(), (2, 64, 8, 8)),
    ("read along another axis", lambda x: relax.op.permute_dims(x, [0, 3, 2, 1]), (2, 4, 6, 8)),
    ("a reduction", lambda x: relax.op.sum(x, axis=[1]), (2, 3, 8, 8)),
    ("a broadcast along the row", lambda x: relax.op.add(
        x, relax.op.expand_dims(relax.const(np.arange(16, dtype="float16")), -1)), (2, 16, 16, 8)),
    ("a reshape: rows read whole", lambda x: relax.op.reshape(x, (2, 16, 16, 8)), (2, 16, 128)),
    ("a reshape across rows: rows read whole", lambda x: relax.op.reshape(x, (2, 24, 8)), (2, 16, 12)),
    ("12 channels: 24 bytes, no whole pieces", _nhwc(), (2, 12, 10, 12)),
])
def test_other_kernels_are_not_taken_by_short_inner_axis(sm90, what, build, shape):
    """Where Fallback's threads already read along the row (no transpose, a
    value broadcast along the row, a reshape whose row is a contiguous
    piece of the input's), the row is long (TiledTranspose's), the
    transposed read does not follow the axis neighbouring threads walk
    (NCHW -> NWHC: a thread's row would be strided reads of its own), or the
    kernel reduces. (fp16: rows of 8 are 16 bytes, short enough.)"""
    func = _kernel(build, sm90, shape, "float16")
    with sm90:
        assert ShortInnerAxis().apply(func, sm90) is None, what


@pytest.mark.gpu
@pytest.mark.parametrize("what, build, shape", CASES, ids=[c[0] for c in CASES])
def test_gpu_a_transpose_into_a_short_last_axis(what, build, shape):
    _check(ShortInnerAxis, build, shape, "float32", on_gpu=True)


TILED = [  # (what, build, input shape)
    ("ShuffleNet's 116 channels made NHWC", lambda x: relax.op.permute_dims(x, [0, 2, 3, 1]), (2, 116, 28, 28)),
    ("odd sizes", lambda x: relax.op.permute_dims(x, [0, 2, 3, 1]), (1, 37, 9, 41)),
    ("a 2-D result made NCHW", lambda x: relax.op.permute_dims(relax.op.reshape(x, (2, 8, 40, 64)), [0, 3, 1, 2]),
     (2 * 8 * 40, 64)),
    ("the last two axes swapped, fp32", lambda x: relax.op.permute_dims(x, [0, 2, 1]), (3, 50, 70)),
    ("the batch reshaped (divisions outside the tile)",
     lambda x: relax.op.permute_dims(relax.op.reshape(x, (4, 40, 64)), [0, 2, 1]), (2, 2, 40, 64)),
]


@pytest.mark.parametrize("what, build, shape", TILED, ids=[c[0] for c in TILED])
def test_a_tiled_transpose_computes_what_tvms_plain_lowering_does(what, build, shape):
    """In emulation: every output element written once, no shared-memory
    race or read of a tile element never written; tiles cut by the edges."""
    _check(TiledTranspose, build, shape, "float32" if "fp32" in what else "float16")


def test_a_tiled_transposes_tile_has_padded_rows_and_is_first_in_the_chain(sm90):
    func = _kernel(lambda x: relax.op.permute_dims(x, [0, 2, 3, 1]), sm90, (32, 232, 14, 14), "float16")
    gv = tvm.ir.GlobalVar("main")
    with sm90:
        name, sch = next(s for s in schedule._sources(gv, func, None, sm90, "cuda") if not isinstance(s[1], Exception))
    assert name == schedule.TILED_TRANSPOSE
    from .. import emulation

    src = emulation.source(sch, sm90)
    assert "__shared__ alignas(64) half x_shared_ptr[" in src and "__syncthreads()" in src
    # 32 channels' rows of 14 pixels, each row 32 + 2 elements apart (68 bytes: a column's 32 reads on 32 banks)
    assert "x_shared_ptr[1088]" in src and "* 34)" in src, src[src.index("main_kernel("):]


@pytest.mark.parametrize("what, build, shape, dtype", [
    ("an embedding's lookup", lambda x: relax.op.take(relax.const(np.ones((100, 64), "float16")), x, axis=0),
     (4, 16), "int64"),
    ("3 colours made NCHW", lambda x: relax.op.permute_dims(x, [0, 3, 1, 2]), (2, 64, 64, 3), "float16"),
    ("a short row", lambda x: relax.op.permute_dims(x, [0, 2, 3, 1]), (2, 16, 32, 32), "float16"),
    ("a resize's arithmetic", lambda x: relax.op.permute_dims(
        relax.op.image.resize2d(x, (64, 64), layout="NHWC"), [0, 3, 1, 2]), (2, 32, 32, 64), "float16"),
    ("a reshape's division", lambda x: relax.op.permute_dims(relax.op.reshape(x, (2, 280, 64)), [0, 2, 1]),
     (2, 40, 7, 64), "float16"),
    ("a strided slice", lambda x: relax.op.permute_dims(
        relax.op.strided_slice(x, axes=[0], begin=[0], end=[640], strides=[10]), [1, 0]), (640, 96), "float16"),
])
def test_other_kernels_are_not_tiled(sm90, what, build, shape, dtype):
    """A read that is a broadcast along the row (an embedding's indices),
    an axis too short to tile, a short row (ShortInnerAxis's or Fallback's),
    an index along the tile other than the iterator with a stride of 1 (a
    resize's arithmetic, a reshape's division: the tile's region the whole
    buffer; a strided slice: a 32-row tile spanning 320 rows, 21 KB of
    shared memory for 2)."""
    func = _kernel(build, sm90, shape, dtype)
    with sm90:
        assert TiledTranspose().apply(func, sm90) is None, what


@pytest.mark.gpu
@pytest.mark.parametrize("what, build, shape", TILED, ids=[c[0] for c in TILED])
def test_gpu_a_tiled_transpose(what, build, shape):
    _check(TiledTranspose, build, shape, "float32" if "fp32" in what else "float16", on_gpu=True)


def test_the_probes_kernels_are_each_taken_by_the_rule_it_times(sm90):
    """scripts/movement_probe.py times our rules against Fallback on the
    corpus's transposes: each of its kernels is one our rule takes."""
    from ..conftest import load_script

    probe = load_script("movement_probe")
    common = load_script("probe_common")
    for name, (rule, build, shape, dtype, *more) in probe._cases().items():
        func = common.fused_kernel(build, shape, dtype, sm90, *more)
        with sm90:
            assert getattr(gpu_movement, probe.RULES[rule])().apply(func, sm90) is not None, name


@pytest.mark.gpu
def test_gpu_the_movement_probe(tmp_path):
    """Every kernel built both ways on the GPU, their outputs equal (rc 0)."""
    from ..conftest import load_script

    assert load_script("movement_probe").main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / "probe.md").is_file()


@pytest.mark.parametrize("what, build, shape, found", [
    ("a plain transpose", lambda x: relax.op.permute_dims(x, [0, 2, 1]), (2, 40, 64), True),
    ("a reshape's division", lambda x: relax.op.permute_dims(relax.op.reshape(x, (2, 280, 64)), [0, 2, 1]),
     (2, 40, 7, 64), False),
    ("a strided slice", lambda x: relax.op.permute_dims(
        relax.op.strided_slice(x, axes=[0], begin=[0], end=[640], strides=[10]), [1, 0]), (640, 96), False),
    ("the batch reshaped", lambda x: relax.op.permute_dims(relax.op.reshape(x, (4, 40, 64)), [0, 2, 1]),
     (2, 2, 40, 64), True),
])
def test_the_tiled_read_is_a_plain_transpose(sm90, what, build, shape, found):
    """`_transposed_read` itself (TiledTranspose also declines a tile larger
    than TILE x TILE, which would hide it): an index that divides or strides
    along the tile is not a plain transpose; one dividing outside it is."""
    from deploy.passes.gpu_movement import _injective_block, _transposed_read

    sch, block, _ = _injective_block(_kernel(build, sm90, shape, "float16"), sm90)
    assert (_transposed_read(sch.get(block)) is not None) == found, what


def _resize(x):
    return relax.op.image.resize2d(x, (64, 64), layout="NHWC", method="nearest_neighbor",
                                   coordinate_transformation_mode="asymmetric", rounding_method="floor")


def _relu6(x):
    """MobileNet-V2's ReLU6 after mixed precision: clipped in fp32 between two fp32 constants."""
    y = relax.op.maximum(relax.op.astype(x, "float32"), relax.const(0.0, "float32"))
    return relax.op.astype(relax.op.minimum(y, relax.const(6.0, "float32")), "float16")


VECTOR = [  # (what, build, input shape, dtype)
    ("a nearest resize x2, NHWC", _resize, (2, 32, 32, 64), "float16"),
    ("a spatial pad", lambda x: relax.op.nn.pad(x, [0, 0, 1, 1, 2, 2, 0, 0]), (2, 10, 12, 24), "float16"),
    ("a cast fp32 -> fp16", lambda x: relax.op.astype(x, "float16"), (2, 7, 9, 64), "float32"),
    ("fp32 rows of 4", lambda x: relax.op.nn.relu(x), (3, 5, 4), "float32"),
    ("ReLU6 in fp32 of fp16 rows (pieces of 8 bytes)", _relu6, (2, 6, 6, 64), "float16"),
    ("a slice at channel 8, added to a per-channel constant", lambda x: relax.op.add(
        relax.op.strided_slice(x, axes=[3], begin=[8], end=[40]),
        relax.const(np.arange(32, dtype="float16"))), (2, 6, 6, 48), "float16"),
    ("a slice at channel 4 (16 bytes would straddle: pieces of 8)",
     lambda x: relax.op.strided_slice(x, axes=[3], begin=[4], end=[36]), (2, 6, 6, 48), "float16"),
]


@pytest.mark.parametrize("what, build, shape, dtype", VECTOR, ids=[c[0] for c in VECTOR])
def test_rows_in_vectors_compute_what_tvms_plain_lowering_does(what, build, shape, dtype):
    _check(VectorRows, build, shape, dtype)


def test_a_row_piece_is_one_vector_load_and_store_and_vector_rows_is_next_to_last(sm90):
    func = _kernel(_resize, sm90, (2, 32, 32, 64), "float16")
    gv = tvm.ir.GlobalVar("main")
    with sm90:
        name, sch = next(s for s in schedule._sources(gv, func, None, sm90, "cuda") if not isinstance(s[1], Exception))
    assert name == schedule.VECTOR_ROWS
    assert schedule.CHAINS["cuda"][-2:] == [schedule.VECTOR_ROWS, "dlight.Fallback"]
    from .. import emulation

    src = emulation.source(sch, sm90)
    body = src[src.index("main_kernel("):]
    assert body.count("*(uint4*)(") == 2, body  # the piece's load and its store


def test_eight_fp32_lanes_with_a_broadcast_become_two_pieces_of_four(sm90):
    """TVM 0.27 prints a broadcast of 8 fp32 lanes as `make_ulonglong4`
    of 8 arguments, which nvcc rejects (passes/attention_schedule.py's
    workaround, tests/passes/test_attention.py's test of it): ReLU6's pieces
    are 8 bytes, 4 lanes, and its CUDA calls no make_ulonglong4."""
    func = _kernel(_relu6, sm90, (2, 6, 6, 64), "float16")
    with sm90:
        sch = VectorRows().apply(func, sm90)
    from .. import emulation

    src = emulation.source(sch.mod["main"], sm90)
    assert "make_ulonglong4(" not in src and "make_float4(" in src, src[src.index("main_kernel("):]


PRINTED = [  # kernels whose 8-lane vectors TVM 0.27's CUDA codegen cannot print (bool, int64, float64)
    ("LeakyReLU (a comparison along the row)", lambda x: relax.op.nn.leakyrelu(x, 0.1), (2, 6, 32), "float16"),
    ("LeakyReLU in bf16", lambda x: relax.op.nn.leakyrelu(x, 0.1), (2, 6, 32), "bfloat16"),
    ("PReLU", lambda x: relax.op.nn.prelu(x, relax.const(np.full((32,), 0.2, "float16")), axis=2), (2, 6, 32),
     "float16"),
    ("a where along the row", lambda x: relax.op.where(relax.op.greater(x, relax.const(0.0, "float16")), x,
                                                       relax.op.multiply(x, x)), (2, 6, 32), "float16"),
    ("x * (x > 0)", lambda x: relax.op.multiply(x, relax.op.astype(
        relax.op.greater(x, relax.const(0.0, "float16")), "float16")), (2, 6, 32), "float16"),
    ("bool to fp16", lambda x: relax.op.astype(x, "float16"), (2, 6, 16), "bool"),
    ("int64 to fp16", lambda x: relax.op.astype(x, "float16"), (2, 6, 16), "int64"),
    ("fp16 through int64", lambda x: relax.op.astype(relax.op.astype(x, "int64"), "float16"), (2, 6, 16), "float16"),
    ("float64 to fp16", lambda x: relax.op.astype(x, "float16"), (2, 6, 16), "float64"),
]


@pytest.mark.parametrize("what, build, shape, dtype", PRINTED, ids=[c[0] for c in PRINTED])
def test_what_vector_rows_takes_tvm_prints_as_cuda(sm90, what, build, shape, dtype):
    """Declined, or smaller pieces: each kernel it takes has CUDA source
    (TVM 0.27: "Cannot convert type T.boolx8 to CUDA type" and the like
    for 8 lanes of a comparison, an int64 or a float64 read, any vector
    cast to int64)."""
    func = _kernel(build, sm90, shape, dtype)
    with sm90:
        sch = VectorRows().apply(func, sm90)
    if sch is not None:
        from .. import emulation

        assert "main_kernel(" in emulation.source(sch.mod["main"], sm90)


@pytest.mark.parametrize("what, build, shape, dtype", [
    ("a concatenation along the row (its condition scalarizes the piece)",
     lambda x: relax.op.concat([x, relax.op.multiply(x, relax.const(2.0, "float16"))], axis=3), (2, 6, 6, 32),
     "float16"),
    ("rows of 8 bytes", lambda x: relax.op.nn.relu(x), (2, 6, 6, 4), "float16"),
    ("rows of 24 bytes", lambda x: relax.op.nn.relu(x), (2, 6, 6, 12), "float16"),
    ("a transpose", lambda x: relax.op.permute_dims(x, [0, 2, 1]), (2, 40, 64), "float16"),
    ("int64 rows", lambda x: relax.op.add(x, relax.const(1, "int64")), (2, 6, 16), "int64"),
    ("a bilinear resize (its reads' regions bounds of float arithmetic, not elements)",
     lambda x: relax.op.image.resize2d(x, (48, 48), layout="NHWC"), (2, 32, 32, 16), "float16"),
    ("DeepLab's bilinear upsampling made NCHW (the region of its read did not follow the row: built, it failed)",
     lambda x: relax.op.astype(relax.op.permute_dims(relax.op.image.resize2d(x, (64, 64), layout="NHWC"),
                                                     [0, 3, 1, 2]), "float32"), (2, 16, 16, 24), "float16"),
])
def test_other_kernels_are_not_taken_by_vector_rows(sm90, what, build, shape, dtype):
    func = _kernel(build, sm90, shape, dtype)
    with sm90:
        assert VectorRows().apply(func, sm90) is None, what


def test_vector_rows_off_leaves_fallback_its_kernels(sm90, monkeypatch):
    monkeypatch.setattr(gpu_movement, "VECTOR_ROWS", False)
    with sm90:
        assert VectorRows().apply(_kernel(_resize, sm90, (2, 32, 32, 64), "float16"), sm90) is None


@pytest.mark.gpu
@pytest.mark.parametrize("what, build, shape, dtype", VECTOR, ids=[c[0] for c in VECTOR])
def test_gpu_rows_in_vectors(what, build, shape, dtype):
    _check(VectorRows, build, shape, dtype, on_gpu=True)


def test_rule_kernels_emulates_and_compiles_what_a_rule_takes(sm90):
    """scripts/rule_kernels.py, the corpus-wide check of a rule's kernels:
    a kernel of ours emulated equal and compiled by nvcc; the C TVM 0.27
    prints for 8 fp32 lanes of a broadcast refused by nvcc."""
    import shutil

    from ..conftest import load_script

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here")
    script = load_script("rule_kernels")
    func = _kernel(_resize, sm90, (2, 32, 32, 64), "float16")
    with sm90:
        found, ok = script.check(func, VectorRows().apply(func, sm90), sm90, emulate=True)
    assert ok and found == "equal; nvcc ok", found
    bad = ('extern "C" __global__ void k(float* p, unsigned long long* o) '
           "{ ulonglong4 v = make_ulonglong4(p[0], p[0], p[0], p[0], p[0], p[0], p[0], p[0]); o[0] = v.x; }")
    assert "too many arguments" in script.nvcc_error(bad)


@pytest.mark.parametrize("what, build, shape, dtype, error", [
    ("LeakyReLU's comparison, 8 lanes", lambda x: relax.op.nn.leakyrelu(x, 0.1), (2, 6, 32), "float16",
     "Cannot convert type T.boolx8 to CUDA type"),
    ("an int64 read, 8 lanes", lambda x: relax.op.astype(x, "float16"), (2, 6, 16), "int64", "type_name.empty()"),
    ("a vector cast to int64, 8 lanes", lambda x: relax.op.astype(relax.op.astype(x, "int64"), "float16"),
     (2, 6, 16), "float16", "type_name.empty()"),
])
def test_tvm_cannot_print_these_vectors_in_cuda(sm90, what, build, shape, dtype, error):
    """The defects VectorRows' smaller pieces and declines work around
    (`_unprintable_8`): TVM 0.27's CUDA codegen fails on 8 lanes of them
    (of 4 it prints them: `test_what_vector_rows_takes_tvm_prints_as_cuda`).
    Fails once it prints them; then the guard can go."""
    from .. import emulation

    func = _kernel(build, sm90, shape, dtype)
    with sm90:
        base, block, _ = gpu_movement._injective_block(func, sm90)
        sch = VectorRows._schedule(base, block, shape[-1], 8)
    with pytest.raises(Exception, match=re.escape(error)):
        emulation.source(sch.mod["main"], sm90)


def _concat(*channels, branch=relax.op.nn.relu, depth_to_space=False):
    """A concatenation along NHWC's channels of the input's first `channels[0]`
    channels and of other kernels' outputs (cumulative sums, one through
    `branch`) of `channels[1:]` channels, DenseNet's and U-Net's skip
    connections; `depth_to_space`: the second made by a depth to space of 2x2
    pixels (U-Net's GEMM-made upsampling, passes/conv_transpose.py) in the
    kernel. One input of (2, 6, 6, sum of channels) (12x12 with depth_to_space)."""
    def build(bb, x):
        n, h, w = (2, 12, 12) if depth_to_space else (2, 6, 6)
        parts, start = [], 0
        for i, c in enumerate(channels):
            part = relax.op.strided_slice(x, axes=[3], begin=[start], end=[start + c])
            start += c
            if i == 1 and depth_to_space:
                small = bb.emit(relax.op.cumsum(relax.op.strided_slice(
                    relax.op.reshape(x, [2, 6, 6, 4 * sum(channels)]), axes=[3], begin=[0], end=[4 * c]), axis=3))
                part = relax.op.reshape(relax.op.permute_dims(relax.op.reshape(small, [2, 6, 6, 2, 2, c]),
                                                              [0, 1, 3, 2, 4, 5]), [n, h, w, c])
            elif i:
                part = bb.emit(relax.op.cumsum(part, axis=2 if i % 2 else 1))
                part = branch(part) if i == len(channels) - 1 else part
            parts.append(part)
        return relax.op.concat(parts, axis=3)
    return build


def _concat_kernel(build, target, shape, dtype="float16"):
    (func,) = [f for n, f in _kernels(build, target, shape, dtype).items() if "concat" in n]
    return func


CONCATS = [  # (what, build, input shape, piece bytes)
    ("three of 32 channels", _concat(32, 32, 32), (2, 6, 6, 96), 16),
    ("DenseNet's 64 + 32", _concat(64, 32), (2, 6, 6, 96), 16),
    ("36 + 28 channels (pieces of 4)", _concat(36, 28), (2, 6, 6, 64), 8),
    ("a depth to space in it, 16 + 16", _concat(16, 16, depth_to_space=True), (2, 12, 12, 32), 16),
]


@pytest.mark.parametrize("what, build, shape, piece", CONCATS, ids=[c[0] for c in CONCATS])
def test_a_concatenation_along_the_row_is_moved_in_vectors(sm90, what, build, shape, piece):
    """VectorRows on concatenations: each piece's condition made the piece's
    (passes/piece_conditions.py), so each piece is loaded from the one input it
    lies in and stored as one vector; emulated against TVM's plain lowering
    (equal bit for bit), and its CUDA's loads and stores vectors of the
    piece (`uint4` of 16 bytes, `half4` of 8)."""
    from .. import emulation

    sch = _check(VectorRows, build, shape, "float16", kernel=_concat_kernel)
    src = emulation.source(sch.mod["main"], sm90)
    body = src[src.index("main_kernel("):]
    vector = {16: "uint4", 8: "half4"}[piece]
    assert f"*({vector}*)(T_concat_intermediate_ptr + " in body, body
    assert body.count(f"*({vector}*)(") == len(sch.mod["main"].params), body  # (a load from each input, the store)


def test_tvms_vectorizer_gives_up_a_concatenations_piece(sm90):
    """Why passes/piece_conditions.py exists: TVM 0.27 vectorizes before it
    simplifies `64 <= p * 8 + lane` (lane < 8) to `8 <= p`, so a
    concatenation's condition, which varies within the piece, makes its
    vectorizer fall back to a loop of scalars. Fails once TVM keeps the
    piece a vector; then the rewrite can go."""
    func = _concat_kernel(_concat(32, 32, 32), sm90, (2, 6, 6, 96))
    with sm90:
        base, block, _ = gpu_movement._injective_block(func, sm90)
        sch = VectorRows._schedule(base, block, 96, 8)
    assert not gpu_movement._vectors(gpu_movement._lowered_vectors(sch.mod), "float16", 8)


def test_only_a_comparison_of_the_iterator_alone_with_a_multiple_of_the_piece_is_rewritten():
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def kernel(a: T.Buffer((T.int64(4), T.int64(64)), "float16"), b: T.Buffer((T.int64(4), T.int64(64)), "float16")):
        for i, j in T.grid(T.int64(4), T.int64(64)):
            with T.sblock("k"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = T.if_then_else(T.int64(32) <= vj, a[vi, vj], T.if_then_else(
                    vj < T.int64(12), a[vi, vj] * T.float16(2), T.if_then_else(
                        T.int64(16) <= vj - T.int64(8), a[vi, vj] * T.float16(3), T.if_then_else(
                            vj >= T.int64(24) and vi < T.int64(2), a[vi, vj], T.float16(0)))))

    from deploy.passes import piece_conditions
    from deploy.tvm_compat import s_tir

    sch = s_tir.Schedule(kernel)
    vi, vj = [iv.var for iv in sch.get(sch.get_sblock("k")).iter_vars]
    got = piece_conditions.piece_conditions(kernel, vj, 8).script()
    assert "T.int64(4) <= vj // T.int64(8)" in got  # 32 <= vj
    assert "vj < T.int64(12)" in got  # (12 is not a multiple of 8)
    assert "T.int64(16) <= vj - T.int64(8)" in got  # (vj - 8 is not vj alone)
    assert "vj // T.int64(8) >= T.int64(3)" in got  # 24 <= vj, in a conjunction
    assert piece_conditions.piece_conditions(kernel, vi, 8) is None  # (vi < 2: 2 is not a multiple of 8)


def test_a_concatenation_with_a_comparison_in_a_branch_takes_pieces_tvm_prints(sm90):
    """LeakyReLU in one input's branch: 8 lanes of its comparison are 8
    bools, which TVM 0.27 cannot print (`_unprintable_8`), so pieces of 4;
    compiled by nvcc (the emulator holds no bool vectors)."""
    import shutil

    from .. import emulation
    from ..conftest import load_script

    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here")
    func = _concat_kernel(_concat(32, 32, branch=lambda y: relax.op.nn.leakyrelu(y, 0.1)), sm90, (2, 6, 6, 64))
    with sm90:
        sch = VectorRows().apply(func, sm90)
    src = emulation.source(sch.mod["main"], sm90)
    assert "*(half4*)(T_concat_intermediate_ptr + " in src
    assert load_script("rule_kernels").nvcc_error(src) is None


@pytest.mark.gpu
@pytest.mark.parametrize("what, build, shape, piece", CONCATS, ids=[c[0] for c in CONCATS])
def test_gpu_a_concatenation_in_vectors(what, build, shape, piece):
    _check(VectorRows, build, shape, "float16", on_gpu=True, kernel=_concat_kernel)
