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
a warp at the same address (a broadcast), the epilogue (cast, bias,
activation, residual) applied as the thread writes its row. Reads and
writes stay coalesced across a warp's rows.

It applies to the GEMMs `mma_gemm.match` takes (one reduction block
`C[i, j] += A[i, k] * B[k, j]` or `B[j, k]`, fp16 in and fp32 sums, its
producers injective, its epilogue element-wise at [i, j]), with fewer than
`mma_gemm.SMALL_COLS` columns, at most `MAX_K` steps, a B of at most
`MAX_B_BYTES` and at least `MIN_ROWS` rows. An fp32 GEMM that TF32 is
allowed for (`PRECISION=tf32`, passes/tf32.py) is computed in strict fp32
here: there is no tensor core in this schedule. In the CUDA chain (passes/schedule.py) it comes just
after our mma.sync GEMM and before DLight's Matmul.
"""

from __future__ import annotations

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
        gemm = mma_gemm.match(func, multiple=1)
        if gemm is None or gemm.n >= mma_gemm.SMALL_COLS or gemm.k > MAX_K or gemm.m < MIN_ROWS:
            return None
        if gemm.k * gemm.n * _bytes(gemm.dtype) > MAX_B_BYTES:
            return None  # (B staged whole in static shared memory)
        try:
            return schedule(func, gemm)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None


def _bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def columns_a_thread(m: int, n: int) -> int:
    """The columns of a row one thread computes: all `n`, or where that
    leaves fewer than WANT_THREADS threads (EfficientNet-B0's 12,544
    pixels at batch 1), the largest divisor of `n` that gives that many,
    else the smallest of at least MIN_COLUMNS: the threads of a row then
    read its A at the same addresses (L1 serves the others)."""
    allowed = [c for c in range(n, 0, -1) if n % c == 0 and (c >= MIN_COLUMNS or c == n)]
    return next((c for c in allowed if m * (n // c) >= WANT_THREADS), allowed[-1])


def schedule(func, gemm):
    """`func`'s GEMM a thread a row (see the module's docstring)."""
    from ..tvm_compat import s_tir, tvm

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    main = sch.get_sblock(gemm.name)
    for name in reversed(gemm.producers):  # (a padding or gather: computed as the row is loaded)
        sch.compute_inline(sch.get_sblock(name))
    for name in gemm.epilogue[:-1]:
        sch.compute_inline(sch.get_sblock(name))
    widest = 16 // _bytes(gemm.dtype)  # (16 bytes at most: 8 fp16, 4 fp32 of a TF32-marked kernel)
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
    b_shared = sch.cache_read(main, 1, "shared")
    sch.compute_at(b_shared, bx, preserve_unit_loops=True)
    copy = sch.fuse(*sch.get_loops(b_shared)[1:])
    _, copy_tx = sch.split(copy, factors=[None, THREADS])
    sch.bind(copy_tx, "threadIdx.x")
    # A: the row's next `lanes` elements into registers, one vector load.
    a_local = sch.cache_read(main, 0, "local")
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
