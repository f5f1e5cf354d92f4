"""A default CUDA schedule of ours for fp32 GEMMs and convolutions on the
CUDA cores (`SimtGemm`): the kernels of a strict-fp32 package, which no
tensor core may compute.

Why our own: DLight's Matmul takes them (25 of ResNet-50's 29 kernels at
batch 64 in fp32) with a 32 x 64 tile a block of 128 threads, each thread
4 x 4 outputs, its A and B tiles in shared memory as [rows, 16 steps] and
read one float at a time: two FMAs a shared-memory load, where an SM
issues four FMAs for each load. The package ran 34.6 ms at batch 64 on an
H200 with 7 of its 29 kernels tuned, against cuDNN's 19.4 ms
(results/h200/2026-11-30/bench-resnet50-fp32-b64/).

`SimtGemm` is the classic SGEMM design:

- a block computes a `bm x bn` tile of C (128 x 128, or 128 x 64, 64 x 128,
  64 x 64 where the larger tiles leave the GPU too few blocks or pad the
  GEMM more) with 256 threads as 16 x 16;
- a thread computes 8 x 8 (or 4 x 8, ...) outputs as 4 x 4 pieces 64 rows
  or columns apart (TVM's virtual threads), its sums in fp32 registers;
- A and B are staged `K_TILE` steps at a time in shared memory stored
  step-major ([k][row], rows padded by 4 floats), so a thread reads its 4
  rows (or columns) at a step as one 16-byte load, and a warp's 16-byte
  loads touch distinct banks or the same address: 16 FMAs a 16-byte load
  (nvcc keeps each piece's load for the pieces beside it). Where K is the
  operand's contiguous axis (NHWC channels, OHWI or [N, K] weights), each
  thread copies 16 bytes along K from global memory and stores them as 4
  floats to the transposed tile, 2-way bank conflicts (threads 2
  steps-of-4 apart share a bank: no 16-byte-aligned padding avoids it with
  this copy), 16 such stores a K tile against its 1,024 FMAs; where its
  rows are (a dense layer's [K, N] weight, attention's V), it copies 16
  bytes of a step's rows as they are stored, to 16 in the tile;
- the epilogue (bias, residual, activation) is applied as the thread
  writes its outputs, four columns at a time;
- with STAGES = 2 (an option), TVM's software pipeline over the K tiles:
  the next tile's copies issued as cp.async (4 bytes each along K, 16
  along rows) before this tile's FMAs. On an H100 it gained nothing
  overall (ResNet-50 b64: 16.377 ms against one stage's 16.300; per kernel
  10% faster to 12% slower), so one stage is the default.

On that H100, untuned, ResNet-50 strict fp32 at batch 64 ran 16.300 ms
with the rule against 34.348 with DLight's Matmul, and 16.296 against
strict-fp32 eager's 20.460 in one bench run
(results/h100/2026-12-07/simt-gemm-resnet50-fp32-b64/).

It applies where DLight's Matmul would: one reduction block that DLight's
index analysis (`get_index_map`) reads as a batched GEMM `C[s, i, j] +=
A[s, i, k] * B[s, j, k]` (a matmul, a batched matmul, a dense layer, a
direct convolution with its padding, read as an implicit GEMM), its body a
sum of products (K is padded with zeros), with fp32 operands and sums,
static extents and at least `MIN_BLOCKS` blocks of the smallest tile: an
fp16 GEMM is our mma.sync's or DLight's tensor cores'. The blocks are one
grid axis (x: CUDA's y stops at 65,535 blocks, which a 512 x 512 image at
batch 32 would pass). A kernel it cannot schedule (a ScheduleError, or
DLight's inlining helpers refusing an epilogue) is declined, as DLight's
rules decline theirs. In the CUDA chain (passes/schedule.py) it comes
just before DLight's Matmul.
"""

from __future__ import annotations

from .kernel_shape import linear_stride, static_int, vars_of
from .mma_gemm import is_multiply_accumulate
from .tensor_core_smem import SIMT_ASYNC

SIMT_GEMM = True  # the rule in the chain (an A/B switch: scripts/with_settings.py)
THREADS_X = 16  # threads a block along C's columns (threadIdx.x: a warp writes rows of 64 floats)
THREADS_Y = 16  # ... and along its rows
PIECE = 4  # a thread's outputs come in PIECE x PIECE pieces (one 16-byte shared load a row or column)
K_TILE = 16  # reduction steps staged in shared memory at a time
PAD = 4  # floats added to a staged row (PAD x 4 bytes: a 16-byte load stays aligned)
MIN_BLOCKS = 128  # about a block an SM (an H200 has 132): fewer leave the GPU idle
MAX_PADDING = 1 / 16  # a larger tile's extra padded work, at most (it reads A and B fewer times)
# K tiles in shared memory at once: 2, the next one's copies (cp.async) overlapping this one's FMAs (3 would
# pass 48 KB of static shared memory at 128 x 128)
STAGES = 1
UNROLL = 256  # pragma_auto_unroll_max_step over a block's K_TILE steps
# (rows, columns) of a block's tile, largest first: 2 x 2, 2 x 1, 1 x 2, 1 x 1 pieces a thread
TILES = ((128, 128), (128, 64), (64, 128), (64, 64))


class SimtGemm:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply). `tunable` is ignored:
    MetaSchedule's own design spaces apply when tuning."""

    def apply(self, func, target, _tunable=False):
        if not SIMT_GEMM or target.kind.name != "cuda":
            return None
        try:
            return schedule(func)
        except Exception:  # noqa: BLE001 - a ScheduleError or an unexpected shape: not this rule's kernel
            return None


def choose_tile(m: int, n: int, batch: int = 1) -> tuple[int, int] | None:
    """The block tile for `batch` m x n GEMMs: of `TILES`, those giving at
    least MIN_BLOCKS blocks, the largest whose padding of m and n costs at
    most MAX_PADDING more work than the least padded of them (ResNet-50's
    3,136 rows at batch 64 take 128-row tiles, 2% padding); None where even
    the smallest gives fewer blocks."""
    def blocks(t):
        return batch * -(-m // t[0]) * -(-n // t[1])

    def padded(t):
        return -(-m // t[0]) * t[0] * -(-n // t[1]) * t[1]

    fit = [t for t in TILES if blocks(t) >= MIN_BLOCKS]
    if not fit:
        return None
    least = min(padded(t) for t in fit)
    return min((t for t in fit if padded(t) <= least * (1 + MAX_PADDING)), key=lambda t: (-t[0] * t[1], padded(t)))


def _rows_contiguous(copy) -> bool:
    """Whether the operand a shared-memory copy block (`copy`: its iterators
    the tile's GEMM, row and step) reads lies with its rows contiguous: the
    innermost index of what it reads is the row plus what does not vary
    with the row or K (a dense layer's [K, N] weight, attention's V),
    rather than varying along K (NHWC channels, OHWI weights, a [N, K]
    weight). Not a row with a stride (an NCHW convolution's at stride 2) or
    wrapping (`row % W`): a 16-byte copy would read the wrong floats."""
    _, row, step = (v.var for v in copy.iter_vars)
    if len(copy.reads) != 1 or static_int(copy.reads[0].region[-1].extent) != 1:
        return False
    last = copy.reads[0].region[-1].min
    if step in vars_of(last):
        return False
    return linear_stride(last, row) == 1


def schedule(func):
    """`func`'s GEMM as the module's docstring says, or None where it is not
    an fp32 GEMM this schedule takes."""
    from ..tvm_compat import dlight, s_tir, tirx

    matmul = dlight.gpu.matmul  # (DLight's Matmul's analysis and inlining helpers: its normal form is ours)
    auto_inline_consumer_chain, auto_inline_producers = matmul.auto_inline_consumer_chain, matmul.auto_inline_producers
    get_index_map, get_reduction_blocks = matmul.get_index_map, matmul.get_reduction_blocks

    if not isinstance(func, tirx.PrimFunc):
        return None
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(dlight.analysis.get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None or len(reductions) != 1:
        return None
    main = reductions[0]
    stmt = sch.get(main)
    if len(stmt.reads) != 2 or any(str(r.source.dtype) != "float32" for r in stmt.reads) \
            or str(stmt.writes[0].source.dtype) != "float32":
        return None
    if get_index_map(stmt) is None or not is_multiply_accumulate(stmt.body, stmt.writes[0].source):
        return None  # (a sum of products only: K is padded with zeros, which another body would not ignore)
    # C[s, i, j] += A[s, i, k] * B[s, j, k], as DLight's Matmul normalizes it.
    a_re = sch.reindex(main, ("read", 0))
    b_re = sch.reindex(main, ("read", 1))
    c_re = sch.reindex(main, ("write", 0))
    gemm_map, a_map, b_map, c_map = get_index_map(sch.get(main))
    sch.transform_layout(a_re, ("write", 0), a_map)
    sch.transform_layout(b_re, ("write", 0), b_map)
    sch.transform_layout(c_re, ("read", 0), c_map)
    sch.transform_block_layout(main, gemm_map)
    gemms, rows, cols, _ = (static_int(sch.get(loop).extent) for loop in sch.get_loops(main))
    tile = choose_tile(rows, cols, gemms) if gemms and rows and cols else None  # (dynamic: DLight's Matmul pads it)
    if tile is None:
        return None
    bm, bn = tile
    sch.pad_einsum(main, [1, bm, bn, K_TILE])
    batch, i, j, k = sch.get_loops(main)
    bi, vi, ti, ii = sch.split(i, [None, bm // (THREADS_Y * PIECE), THREADS_Y, PIECE])
    bj, vj, tj, jj = sch.split(j, [None, bn // (THREADS_X * PIECE), THREADS_X, PIECE])
    ko, ki = sch.split(k, [None, K_TILE])
    sch.reorder(batch, bi, bj, vi, vj, ti, tj, ko, ki, ii, jj)
    # one grid axis (x: up to 2^31 - 1 blocks; y stops at 65,535), the columns' blocks varying fastest: those
    # of a row of tiles run together and share its rows of A in L2
    sch.bind(sch.fuse(batch, bi, bj), "blockIdx.x")
    for piece, axis in ((vi, "vthread.y"), (vj, "vthread.x")):
        if static_int(sch.get(piece).extent) > 1:  # (one piece a thread along this axis: nothing to bind)
            sch.bind(piece, axis)
    sch.bind(ti, "threadIdx.y")
    sch.bind(tj, "threadIdx.x")
    sch.annotate(tj, ann_key="pragma_auto_unroll_max_step", ann_val=UNROLL)
    sch.annotate(tj, ann_key="pragma_unroll_explicit", ann_val=1)

    out = sch.cache_write(main, 0, "local")
    sch.reverse_compute_at(out, tj, preserve_unit_loops=True)
    _, vector = sch.split(sch.get_loops(out)[-1], [None, PIECE])
    sch.vectorize(vector)

    for index in (0, 1):  # A, then B
        staged = sch.cache_read(main, index, "shared")
        sch.compute_at(staged, ko, preserve_unit_loops=True)
        # step-major: [s, row, k] -> [s, k, row], a row padded by PAD floats
        sch.transform_layout(staged, ("write", 0), lambda s, r, kk: (s, kk, r))
        sch.storage_align(staged, 0, axis=1, factor=32, offset=PAD)
        auto_inline_producers(sch, staged)
        _, rows, steps = sch.get_loops(staged)[-3:]  # (the tile's GEMM (1), rows, steps)
        along_rows = _rows_contiguous(sch.get(staged))  # (a dense layer's [K, N] weight: copied as stored)
        if along_rows:
            sch.reorder(steps, rows)
        # 4 lanes a thread, one 16-byte copy: 4 rows at a step along rows (contiguous in both; one cp.async of
        # 16 bytes with STAGES=2), else 4 consecutive steps of a row (a K-contiguous operand's 16-byte load);
        # but with cp.async along K, 4-byte copies: a warp's 16 steps of 2 rows, 64 bytes each
        factors = [None, THREADS_Y, THREADS_X] + ([PIECE] if along_rows or STAGES < 2 else [])
        _, copy_y, copy_x, *lanes = sch.split(sch.fuse(*sch.get_loops(staged)[-3:]), factors)
        for v in lanes:
            sch.vectorize(v)
        sch.bind(copy_y, "threadIdx.y")
        sch.bind(copy_x, "threadIdx.x")
    auto_inline_consumer_chain(sch, out)
    sch.decompose_reduction(main, ko)
    sch.unroll(ki)  # (a block's K_TILE steps in one straight run: the loads of a step issued ahead of its FMAs)
    if STAGES > 1:
        sch.annotate(ko, "software_pipeline_stage", [0, 0, STAGES - 1])
        sch.annotate(ko, "software_pipeline_order", [0, 1, 2])
        sch.annotate(ko, "software_pipeline_async_stages", [0])
        sch.annotate(ko, SIMT_ASYNC, 1)  # (our TIR pipeline: lower this kernel's async stage as cp.async)
    return sch
