"""Default CUDA schedules of ours for kernels that only move data (and cast
or compute elementwise on the way). Those that transpose: into a short
last axis (`ShortInnerAxis`: an image's NCHW input made NHWC, its 3 channels
padded to 8 for the stem's implicit GEMM, passes/implicit_gemm.py, cast to
fp16 on the way), and through shared-memory tiles (`TiledTranspose`, below).

Why our own: nothing but DLight's `Fallback` takes such a kernel, and
Fallback gives each output element a thread, the output's last axis the
fastest: eight threads a pixel, each storing 2 bytes and reading its channel
from a plane of its own. ResNet-50 at batch 64 spent 0.117 ms a call on it on
an H100 (23% of its memory roofline), 4% of its kernel time
(results/h100/2026-12-06/untimed-changes/resnet50-b64/ab-new-profile.log).

Ours gives each thread a row of the output's last axis (a pixel's channels):
the other axes fused and split over blocks of up to 256 threads, the row
computed into registers (its loop unrolled, so a padding's condition folds
and only the real channels are loaded: neighbouring threads read neighbouring
pixels of each plane, coalesced) and stored at once, a vector store where the
row is 4, 8 or 16 bytes and the block size divides the rows (else element by
element).

It applies to a kernel without a reduction that is one block once its
producers and consumers are inlined, writing one buffer whose last axis has
2 or more elements of at most 16 bytes in all, or of 32 (in two pieces of
16 bytes, a thread each: the stem's input blocked in 2 x 2 pixels,
passes/implicit_gemm.space_to_depth, 16 fp16 channels), where some read's
last index follows the axis before that one, and another of its indices
follows that one (a transpose into it, read coalesced by neighbouring
threads; elsewhere, a broadcast along the row or a row read whole,
Fallback's order is as good). `tunable` is ignored: tuning has no design space of
it (MetaSchedule's own spaces apply). It is last in the CUDA chain before
Fallback (passes/schedule.py): it changes only kernels left to Fallback.

`TiledTranspose`, after it, takes the transposes of longer rows: ShuffleNet's
channel shuffle made NHWC ((32, 116, 28, 28) -> (32, 28, 28, 116)), UNet's
NHWC result made NCHW. Fallback's threads walk the output's last axis, so
each reads an element of a row of its own (2 bytes of each 32-byte sector,
in fp16). Ours is the classic tiled transpose: a block a tile of TILE x
TILE, read into shared memory along the input's last axis and written from
it along the output's (both coalesced), the tile's rows padded by 4 bytes so
that reading a column is free of bank conflicts. It takes a kernel of one
injective block writing one buffer in its iterators' order whose last axis
has TILE elements or more, where some read is a plain transpose: its last
index is one of the block's iterators (not the last), which another of its
indices follows with a stride of 1 (a strided slice, a reshape's division or
a resize's arithmetic there would make the tile's region far larger than the
tile).

`VectorRows`, last, takes the kernels that move or compute without
transposing, whose rows are whole 16-byte pieces (8 fp16 channels or more):
a nearest resize, a pad, a cast, a leftover elementwise operator. Fallback
gives each element a thread (2-byte loads and stores, the index arithmetic
of a 4-D position an element); ours gives each thread a 16-byte piece of a
row, loaded and stored as vectors (a `uint4` of fp16s each way), the position
worked out once a piece. It takes a kernel only where TVM's vectorizer
keeps the piece a vector (checked by running it: a condition that varies
within the piece makes it fall back to a loop of scalars, no better than
Fallback) and every read along the row is one element aligned to the piece
(its index there the row's own plus a multiple of the piece, in rows a
whole number of pieces long), so that each load is one vector (TVM gathers
the lanes of a load it cannot prove aligned one by one). A concatenation
along the row (DenseNet's, U-Net's skip connections) tests the position
against each input's first channel: where those are multiples of the
piece, passes/piece_conditions.py makes each test one of the piece
(`64 <= c` as `8 <= c // 8`), which the simplifier turns into the piece's index before
TVM vectorizes, so a piece is read from the one input it lies in, as one
vector (TVM 0.27 vectorizes before it simplifies the test as written:
tests/passes/test_gpu_movement.py::test_tvms_vectorizer_gives_up_a_concatenations_piece).
Pieces are 8 bytes where the reads are aligned to 8 bytes, not 16 (a slice
or a concatenation at channel 4 of fp16), or where 8 lanes would hold what
TVM 0.27's CUDA codegen cannot print (`_unprintable_8`: LeakyReLU's
comparisons, MobileNet-V2's fp32 ReLU6 bounds, a cast through int64). U-Net's
upsampling at batch 32 took 0.40 ms a run on Fallback at 25% of the memory
roofline (results/h100/2026-12-06/corpus-baselines/profiles-b32/unet/);
with VectorRows 0.116 ms, and U-Net b32 1.08x faster in all
(results/h100/2026-12-06/verify-conv-transpose-vector-rows/). Its skip
concatenations were left at 32-34% of the memory roofline, 0.84 of 4.46 ms.
`VECTOR_ROWS = False` leaves those kernels to Fallback (A/Bs).
"""

from __future__ import annotations

import math
import re

THREAD_CHOICES = (256, 128, 64)  # threads a block: the first that divides the rows, else the first
# (not 32: an H100 holds 32 blocks an SM, so blocks of 32 threads would fill half of it)
MAX_ROW_BYTES = 32  # a row at most this long (past 16 bytes: whole 16-byte pieces, a thread each)
PIECE_BYTES = 16
VECTOR_BYTES = (4, 8, 16)  # rows stored as one vector; others element by element
VECTOR_DTYPES = ("float16", "bfloat16", "float32", "int32")  # (CUDA's codegen prints no bool or int64 vectors)
TILE = 32  # TiledTranspose's tiles: TILE x TILE elements (fewer along an axis shorter than TILE)
TILE_THREADS = 256
MIN_TILE_ROWS = 8  # the transposed axis's extent at least this (a tile TILE x this or more)
VECTOR_ROWS = True  # VectorRows takes what it can; False: Fallback does
WIDE_BUFFER = re.compile(r'T\.Buffer\(\(.*?\), "(bool|u?int64|float64)"\)')  # elements whose 8-lane vectors
COMPARISON = re.compile(r" (<|>|<=|>=|==|!=) |T\.Select\(")  # (or whose comparisons' bool vectors) do not print
WIDE_CAST = re.compile(r'T\.Cast\("(bool|u?int64|float64)x8"')  # (and a cast to 8 of them)


def _row(block) -> tuple[int, int, bool] | None:
    """(elements, bytes, vector) of the written buffer's last axis where the
    block writes it element for element in its iterators' order (so its last
    loop walks that axis), vector where one vector store can write it; else
    None."""
    from ..tvm_compat import tirx
    from .kernel_shape import static_int

    (write,) = block.writes
    ivs = [iv.var for iv in block.iter_vars]
    # (normalizing drops unit axes from the iterators: their index is 0)
    indices = [r.min for r, d in zip(write.region, write.source.shape)
               if not (static_int(d) == 1 and static_int(r.min) == 0)]
    if len(indices) != len(ivs) or any(static_int(r.extent) != 1 for r in write.region):
        return None
    if not all(isinstance(i, tirx.Var) and i.same_as(v) for i, v in zip(indices, ivs)):
        return None
    n = static_int(write.source.shape[-1])
    if n is None or n < 2:
        return None
    dtype = str(write.source.dtype)
    size = n * write.source.dtype.bits // 8
    return n, size, size in VECTOR_BYTES and n & (n - 1) == 0 and dtype in VECTOR_DTYPES


def _injective_block(func, target):
    """(schedule, the block, its row as `_row` reads it) of a CUDA kernel
    that is one injective block writing one buffer once its producers and
    consumers are inlined; else None."""
    from ..tvm_compat import dlight, s_tir, tirx

    if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
        return None
    sch = s_tir.Schedule(func)
    try:
        infos = dlight.analysis.normalize_prim_func(sch)
        infos = dlight.base.try_inline(sch, infos) if infos else None
    except Exception:  # noqa: BLE001 - not a kernel DLight can normalize
        return None
    if not infos or len(infos) != 1 or set(infos[0].dom_kind()) != {"S"}:
        return None
    block = sch.get(infos[0].block_rv)
    if len(block.writes) != 1 or len(block.iter_vars) < 2:
        return None
    row = _row(block)
    return None if row is None else (sch, infos[0].block_rv, row)


class ShortInnerAxis:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        from .kernel_shape import static_int, vars_of

        got = _injective_block(func, target)
        if got is None or got[2][1] > MAX_ROW_BYTES:
            return None
        sch, block_rv, (n, size, vector) = got
        block = sch.get(block_rv)
        # A read transposed into the row: its last index follows the axis
        # before the row's, which neighbouring threads walk (so they read
        # neighbouring elements, or every other one: a stem's 2 x 2 blocks of
        # pixels, passes/implicit_gemm.space_to_depth), another of its
        # indices follows the row's own, and the row's neighbouring elements
        # are not neighbours in that read (else a broadcast along the row, or
        # a row read whole, coalesced by Fallback's threads, which walk it).
        last, before = block.iter_vars[-1].var, block.iter_vars[-2].var
        if not any(r.region and before in vars_of(r.region[-1].min)
                   and any(last in vars_of(x.min) for x in r.region[:-1])
                   and not _contiguous(r.region[-1].min, block.iter_vars, n) for r in block.reads):
            return None
        # A row longer than 16 bytes (16 fp16 channels: the blocked stem's
        # input) in pieces of 16, a thread each: a piece one vector store.
        if size > PIECE_BYTES and (size % PIECE_BYTES or n % (size // PIECE_BYTES)):
            return None
        pieces = max(1, size // PIECE_BYTES)
        vector = vector or (pieces > 1 and str(block.writes[0].source.dtype) in VECTOR_DTYPES)
        rows = math.prod(static_int(iv.dom.extent) or 0 for iv in block.iter_vars[:-1]) * pieces  # (0: not static)
        # The row through registers, stored as one vector, only where the
        # threads divide the rows: a cache-write stage moved under the
        # thread loop does not keep the split's predicate, so a partly idle
        # block would store past the end (tests/passes/test_gpu_movement.py).
        threads = next((t for t in THREAD_CHOICES if rows and rows % t == 0), None)
        try:
            loops = sch.get_loops(block_rv)
            if pieces > 1:
                loops = [*loops[:-1], *sch.split(loops[-1], [pieces, None])]
            bx, tx = sch.split(sch.fuse(*loops[:-1]), [None, threads or THREAD_CHOICES[0]])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            if vector and threads:
                store = sch.cache_write(block_rv, 0, "local")
                sch.reverse_compute_at(store, tx)
                sch.vectorize(sch.get_loops(store)[-1])
            sch.unroll(sch.get_loops(block_rv)[-1])
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None
        return sch


def _contiguous(index, iter_vars, n: int) -> bool:
    """Whether `index` steps by 1 as the last iterator walks its `n`
    values, the others at their first (a row read whole by a reshape);
    evaluated, not matched, so that a division or a modulus counts as what
    it does there."""
    from ..tvm_compat import sym, tirx

    got = []
    for k in range(n):
        analyzer = sym.Analyzer()
        for iv in iter_vars[:-1]:
            analyzer.bind(iv.var, iv.dom.min)
        analyzer.bind(iter_vars[-1].var, tirx.const(k, iter_vars[-1].dom.extent.ty))
        value = analyzer.simplify(index)
        if not isinstance(value, tirx.IntImm):
            return False
        got.append(int(value))
    return all(b - a == 1 for a, b in zip(got, got[1:]))


def _transposed_read(block) -> tuple[int, int] | None:
    """(the read's index among the block's reads, the iterator its last
    index is) of the first plain transposed read: its last index one of
    the block's iterators but the last, that iterator in no other index,
    the last iterator in exactly one other index, linearly with a stride of
    1. Not a broadcast (an embedding's indices); not a strided slice, whose
    tile would span the stride; not a reshape splitting the row or a
    resize's arithmetic, whose tile's region would be the whole buffer.
    Indices of the other iterators may be anything: they are fixed in a
    tile."""
    from ..tvm_compat import tirx
    from .kernel_shape import linear_stride, vars_of

    ivs = [iv.var for iv in block.iter_vars]
    for at, r in enumerate(block.reads):
        if not r.region or not isinstance(r.region[-1].min, tirx.Var):
            continue
        j = next((k for k, v in enumerate(ivs[:-1]) if v.same_as(r.region[-1].min)), None)
        if j is None or any(ivs[j] in vars_of(x.min) for x in r.region[:-1]):
            continue
        rows = [x.min for x in r.region[:-1] if ivs[-1] in vars_of(x.min)]
        if len(rows) == 1 and linear_stride(rows[0], ivs[-1]) == 1:
            return at, j
    return None


class TiledTranspose:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        from .kernel_shape import static_int

        got = _injective_block(func, target)
        if got is None or got[2][0] < TILE:
            return None
        sch, block_rv, _ = got
        block = sch.get(block_rv)
        found = _transposed_read(block)
        if found is None:
            return None
        at, j = found
        extents = [static_int(iv.dom.extent) for iv in block.iter_vars]
        if extents[j] is None or extents[j] < MIN_TILE_ROWS:
            return None  # (an axis of 3 colours: tiles of 3 x 32, Fallback's reads as coalesced)
        dtype = block.reads[at].source.dtype
        try:
            loops = sch.get_loops(block_rv)
            jo, ji = sch.split(loops[j], [None, min(TILE, extents[j])])
            lo, li = sch.split(loops[-1], [None, TILE])
            outer = [lp for k, lp in enumerate(loops[:-1]) if k != j]
            sch.reorder(*outer, jo, lo, ji, li)
            bx = sch.fuse(*outer, jo, lo)
            sch.bind(bx, "blockIdx.x")
            tile = sch.cache_read(block_rv, at, "shared")
            sch.compute_at(tile, bx)
            if math.prod(static_int(sch.get(lp).extent) or 0 for lp in sch.get_loops(tile)[1:]) > TILE * TILE:
                return None  # (not the tile `_transposed_read` meant: a region the indices widened)
            # (the tile's rows a multiple of TILE plus 4 bytes: a column read on distinct banks)
            sch.storage_align(tile, 0, axis=-2, factor=TILE, offset=max(1, 32 // dtype.bits))
            for stage_loops in (sch.get_loops(tile)[1:], [ji, li]):  # (the tile's read, then its write)
                _, tx = sch.split(sch.fuse(*stage_loops), [None, TILE_THREADS])
                sch.bind(tx, "threadIdx.x")
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None
        return sch


def _aligned_reads(block, lanes: int) -> bool:
    """Whether each read of `block` along its row is a vector load of
    `lanes` elements aligned to them: each read one element (its region a
    point, so its indices are the read's own), the row's iterator in its last index
    alone, that index the iterator plus a multiple of `lanes` (a constant, or
    other iterators times multiples of it), the buffer's last axis a multiple
    of `lanes`. A read the row's iterator is not in (a
    broadcast along the row) is one scalar load."""
    from ..tvm_compat import sym
    from .kernel_shape import static_int, vars_of

    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    last = block.iter_vars[-1].var
    for r in block.reads:
        if any(static_int(x.extent) != 1 for x in r.region):
            return False  # (a region, not an element: an index too involved to be read exactly, a resize's float)
        indices = [analyzer.simplify(x.min) for x in r.region]
        if not any(last in vars_of(i) for i in indices):
            continue
        if any(last in vars_of(i) for i in indices[:-1]) or static_int(r.source.shape[-1]) is None:
            return False
        # (the offset's residue modulo the piece, as TVM's CUDA codegen judges a vector load aligned: a
        # constant, or a sum of multiples of it, a depth to space's (i * 2 + j) * channels)
        offset = analyzer.modular_set(analyzer.simplify(indices[-1] - last))
        if int(offset.coeff) % lanes or int(offset.base) % lanes or static_int(r.source.shape[-1]) % lanes:
            return False
    return True


def _lowered_vectors(mod) -> str:
    """The scheduled kernel after TVM's vectorizer (where it cannot keep a
    vector loop, it makes a loop of scalars), as TVMScript. The simplifier
    runs first, as in TVM's lowering: it makes a piece's condition one of
    the piece (passes/piece_conditions.py)."""
    from ..tvm_compat import s_tir, tirx, tvm

    S = s_tir.transform
    return tvm.transform.Sequential([S.LowerInitBlock(), S.ConvertBlocksToOpaque(), S.StmtSimplify(),
                                     S.LowerOpaqueBlock(), tirx.transform.VectorizeLoop()])(mod).script()


def _vectors(lowered: str, dtype, lanes: int) -> bool:
    """Whether the vectorizer kept the piece a vector (`lowered`: after it)."""
    return "T.Ramp(" in lowered or f"{dtype}x{lanes}" in lowered


def _scalar_conditions(line: str) -> str:
    """`line` of TVMScript without the conditions of its `T.if_then_else`s
    that hold no vector (one of the whole piece: it selects whole vectors)."""
    out, i = [], 0
    while (j := line.find("T.if_then_else(", i)) >= 0:
        start = j + len("T.if_then_else(")
        depth, k = 0, start
        while k < len(line) and not (depth == 0 and line[k] == ","):
            depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(line[k], 0)
            k += 1
        condition = line[start:k]
        out.append(line[i:start] + ("" if "T.Ramp(" not in condition and "T.Broadcast(" not in condition
                                    else condition))
        i = k
    return "".join(out) + line[i:]


def _unprintable_8(func, lowered: str) -> bool:
    """Whether the kernel's 8-lane vectors (`lowered`: after the vectorizer)
    would hold what TVM 0.27's CUDA codegen cannot print, or prints as C
    nvcc rejects: a value broadcast along 8 fp32 lanes (`make_ulonglong4` of
    8 arguments), a vector of 8 bools (a comparison along the row:
    LeakyReLU's; "Cannot convert type T.boolx8 to CUDA type"), of 8 int64s
    or float64s (a read of such a buffer, a cast to them: "Check failed:
    (!type_name.empty())"). Judged on the text: a line of vectors with a
    comparison in it (other than a condition of the whole piece,
    `_scalar_conditions`), a buffer of such elements, a cast to 8 of them."""
    vectors = [_scalar_conditions(line) for line in lowered.splitlines() if "T.Ramp(" in line or "T.Broadcast(" in line]
    return (("float32" in lowered and any("T.Broadcast(" in line for line in vectors))
            or any(COMPARISON.search(line) for line in vectors) or bool(WIDE_BUFFER.search(func.script()))
            or bool(WIDE_CAST.search(lowered)))


class VectorRows:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        if not VECTOR_ROWS:
            return None
        got = _injective_block(func, target)
        if got is None:
            return None
        base, block_rv, (n, size, _) = got
        dtype = base.get(block_rv).writes[0].source.dtype
        if str(dtype) not in VECTOR_DTYPES or size < PIECE_BYTES or size % PIECE_BYTES:
            return None
        # Pieces of 16 bytes; of 8 where 16 would hold 8 lanes TVM 0.27's CUDA codegen cannot print: 8
        # fp32 lanes with a value broadcast along them (it prints the broadcast as `make_ulonglong4` of 8
        # arguments, which nvcc rejects: the workaround of passes/attention_schedule.py's `_copy_vector`,
        # and its test), or a vector of 8 bools, int64s or float64s (a comparison's: LeakyReLU; an int64
        # or float64 input's or cast's: "Cannot convert type T.boolx8 to CUDA type"). Of 4 lanes, each
        # prints (tests/passes/test_gpu_movement.py::test_tvm_cannot_print_these_vectors_in_cuda).
        for piece in (PIECE_BYTES, PIECE_BYTES // 2):
            lanes = piece * 8 // dtype.bits
            sch = self._schedule(base.copy(), block_rv, n, lanes)
            if sch is None:
                continue  # (a read not aligned to the piece: to half of it, perhaps)
            text = _lowered_vectors(sch.mod)
            if not _vectors(text, dtype, lanes):  # (scalarized: a condition along the row, a concatenation's)
                sch = self._piecewise(base, block_rv, n, lanes)
                text = _lowered_vectors(sch.mod) if sch is not None else ""
                if not _vectors(text, dtype, lanes):
                    return None
            if lanes < 8 or not _unprintable_8(func, text):
                return sch
        return None

    def _piecewise(self, base, block_rv, n: int, lanes: int):
        """The schedule of `base`'s kernel with its conditions along the row
        made the piece's (`piece_conditions`); None where there are none to
        make so, or the reads are not aligned to the piece."""
        from ..tvm_compat import s_tir
        from .piece_conditions import piece_conditions

        block = base.get(block_rv)
        func = piece_conditions(base.mod["main"], block.iter_vars[-1].var, lanes)
        if func is None:
            return None
        sch = s_tir.Schedule(func)
        try:
            block_rv = sch.get_sblock(block.name_hint)
        except Exception:  # noqa: BLE001 - the block not found again: leave the kernel
            return None
        return self._schedule(sch, block_rv, n, lanes)

    @staticmethod
    def _schedule(sch, block_rv, n: int, lanes: int):
        """`sch` (its injective block `block_rv`, rows of `n`) with a piece of `lanes`
        elements a thread, vectorized; None where the reads are not aligned to it."""
        from .kernel_shape import static_int

        block = sch.get(block_rv)
        if not _aligned_reads(block, lanes):
            return None
        pieces = math.prod(static_int(iv.dom.extent) or 0 for iv in block.iter_vars[:-1]) * (n // lanes)
        # (where none divides the pieces, the last block's idle threads are masked by a predicate on the
        # piece, not on its elements: the piece stays a vector)
        threads = next((t for t in THREAD_CHOICES if pieces and pieces % t == 0), THREAD_CHOICES[0])
        try:
            loops = sch.get_loops(block_rv)
            outer, lane = sch.split(loops[-1], [None, lanes])
            bx, tx = sch.split(sch.fuse(*loops[:-1], outer), [None, threads])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            sch.vectorize(lane)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None
        return sch
