"""A default CUDA schedule of ours for GEMMs with many rows and few columns
(`ThinGemm`): a 1x1 convolution to few channels over a large feature map,
a segmentation head's classifier over every pixel, a projection to 16 or
24 channels of a mobile CNN.

Why our own: our `mma.sync` GEMM declines fewer than `mma_gemm.SMALL_COLS`
columns (most of its 64-column tile would be padding), so DLight's Matmul
takes them, and pads the columns to its 64-column tile: U-Net's last
layer at batch 32 (2,097,152 pixels x 32 channels -> 3 classes) computed
21 times the columns it writes, in 65,536 blocks each staging its rows in
shared memory, 275 us a call on an H100 at 16% of its memory roofline
(results/h100/2026-12-06/verify-conv-transpose-vector-rows/ab-unet32/,
the `new` profile), where the 134 MB it reads take 40 us.

`ThinGemm` gives each row a thread: its `n` sums in fp32 registers, its row
of A read 16 bytes at a time (`lanes` halves) into registers, B (K x n, a
few KB) staged once a block in shared memory and read by every thread of
a warp at the same address (a broadcast; where a row's columns are split
over threads, B stored [N, K] puts their reads in the same banks), the
epilogue (cast, bias, activation, residual) applied as the thread writes
its row. A warp's 32 rows are read 16 bytes a row at a time (every sector
used over the row's loads, from L1), and written side by side.

It applies to the GEMMs `mma_gemm.match` takes (one reduction block
`C[i, j] += A[i, k] * B[k, j]` or `B[j, k]`, fp16 or fp32 in and fp32 sums, its
epilogue element-wise at [i, j]; of producers, only A's row padding: a
concatenation into A or an implicit GEMM's gather is declined), with fewer than
`mma_gemm.SMALL_COLS` columns, at most `MAX_K` steps, a B of at most
`MAX_B_BYTES` and at least `MIN_ROWS` rows; an fp32 GEMM too (its sums
exact fp32: there is no tensor core in this schedule), though the corpus's
fp32 packages have none (their 1x1 convolutions stay convolutions:
results/cpu/2026-12-07/corpus-thin-gemm/). In the CUDA chain (passes/schedule.py) it comes just
after our mma.sync GEMM and before DLight's Matmul.
"""

from __future__ import annotations

from .kernel_shape import dtype_bytes

THIN_GEMM = True  # the rule in the chain (an A/B switch: scripts/with_settings.py)
MIN_ROWS = 4096  # a thread a row: fewer rows leave the GPU idle (DLight's Matmul splits the columns too)
MAX_K = 1024  # reduction steps a thread walks
MAX_B_BYTES = 32768  # B, K x N, staged whole in a block's static shared memory (48 KB at most)
THREADS = 128
WANT_THREADS = 65536  # about 4 warps a scheduler on a 132-SM GPU: fewer rows split their columns
MIN_COLUMNS = 4  # ... each thread keeping at least these (its row's loads shared among fewer sums)
UNROLL_STEPS = 8  # vector loads of a row's A unrolled where it has at most these


class ThinGemm:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply). `tunable` is ignored:
    tuning has no design space of it (MetaSchedule's own spaces apply)."""

    def apply(self, func, target, _tunable=False):
        from . import mma_gemm

        if not THIN_GEMM or target.kind.name != "cuda":
            return None
        gemm = mma_gemm.match(func, tf32=True, multiple=1)  # (fp32 too: its sums are exact fp32 here)
        if gemm is None or gemm.n >= mma_gemm.SMALL_COLS or gemm.k > MAX_K or gemm.m < MIN_ROWS:
            return None
        if gemm.k * gemm.n * dtype_bytes(gemm.dtype) > MAX_B_BYTES:
            return None  # (B staged whole in static shared memory)
        try:
            return schedule(func, gemm)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None


def columns_a_thread(m: int, n: int) -> int:
    """The columns of a row one thread computes: all `n`, or where that
    leaves fewer than WANT_THREADS threads (EfficientNet-B0's 12,544
    pixels at batch 1), the largest divisor of `n` that gives that many,
    else the smallest of at least MIN_COLUMNS: the threads of a row then
    read its A at the same addresses (L1 serves the others)."""
    allowed = [c for c in range(n, 0, -1) if n % c == 0 and (c >= MIN_COLUMNS or c == n)]
    return next((c for c in allowed if m * (n // c) >= WANT_THREADS), allowed[-1])


def _row_padding_input(block, a_buf, b_buf):
    """The buffer a producer of A reads, where it is a row padding (one
    2-D buffer read at the block's own [i, k]); raises otherwise: a
    producer of B, a concatenation's (two inputs), an implicit GEMM's
    gather (whose rows no vector load reads) are not this schedule's."""
    from .kernel_shape import point_indices

    written = block.writes[0].source
    own = [str(v.var) for v in block.iter_vars]
    if written.same_as(b_buf) or not written.same_as(a_buf) or len(block.reads) != 1 \
            or [str(x) for x in point_indices(block.reads[0])] != own:
        raise ValueError("not a row padding of A")
    return block.reads[0].source


def schedule(func, gemm):
    """`func`'s GEMM a thread a row (see the module's docstring)."""
    from ..tvm_compat import s_tir, tvm

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    main = sch.get_sblock(gemm.name)
    a_buf, b_buf = (r.source for r in sch.get(main).reads)
    for name in gemm.producers:
        a_buf = _row_padding_input(sch.get(sch.get_sblock(name)), a_buf, b_buf)
        sch.compute_inline(sch.get_sblock(name))  # (the padding: computed as the row is loaded)
    for name in gemm.epilogue[:-1]:
        sch.compute_inline(sch.get_sblock(name))
    widest = 16 // dtype_bytes(gemm.dtype)  # (16 bytes at most: 8 fp16, 4 fp32)
    lanes = next(v for v in (8, 4, 2, 1) if v <= widest and gemm.k % v == 0)
    cols = columns_a_thread(gemm.m, gemm.n)
    i, j, k = sch.get_loops(main)
    jo, ji = sch.split(j, factors=[None, cols])
    ko, ki = sch.split(k, factors=[None, lanes])
    sch.reorder(i, jo, ko, ki, ji)
    bx, tx = sch.split(sch.fuse(i, jo), factors=[None, THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    # B: once a block in shared memory, copied by all its threads.
    reads = [r.source for r in sch.get(main).reads]
    b_shared = sch.cache_read(main, next(n for n, b in enumerate(reads) if b.same_as(b_buf)), "shared")
    sch.compute_at(b_shared, bx, preserve_unit_loops=True)
    copy = sch.fuse(*sch.get_loops(b_shared)[1:])
    _, copy_tx = sch.split(copy, factors=[None, THREADS])
    sch.bind(copy_tx, "threadIdx.x")
    # A: the row's next `lanes` elements into registers, one vector load.
    a_local = sch.cache_read(main, next(n for n, b in enumerate(reads) if b.same_as(a_buf)), "local")
    sch.compute_at(a_local, ko, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(a_local)[-1])
    # The sums in registers; the epilogue applied as the thread writes its row.
    if gemm.epilogue:
        last = sch.get_sblock(gemm.epilogue[-1])
        sch.reverse_compute_at(last, tx, preserve_unit_loops=True)
        sch.set_scope(main, 0, "local")
    else:
        sch.reverse_compute_at(sch.cache_write(main, 0, "local"), tx, preserve_unit_loops=True)
    if gemm.k // lanes <= UNROLL_STEPS:  # (the row's loads all in flight at once)
        sch.unroll(ko)
    sch.unroll(ki)
    sch.unroll(ji)
    sch.decompose_reduction(main, ko)
    return sch
