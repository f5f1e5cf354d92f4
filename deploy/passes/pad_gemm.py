"""GEMM rows padded to a multiple of 128 inside the kernel, so that the tuner
can draw tiles of 64 to 256 rows (a workaround of MetaSchedule's perfect tiling).

MetaSchedule's multi-level tiling splits each loop into factors whose
product is the loop's extent exactly (`SamplePerfectTile`). A GEMM whose
row count has a large prime factor can then only be tiled in tiny or absurd
blocks: ViT-S/16 at batch 32 has 32 x 197 = 6304 token rows, 394 fragments
of 16 = 2 x 197, so every tensor-core candidate covers 16 or 32 rows per
thread block (or 3152). Its tuned fc1, fc2 and QKV GEMMs reached 10 to 18%
of the H200's fp16 peak (tuning_logs/vit/.../fp16-nhwc-b32: the best
records' row tiles are all [197, 1, 1, 2, 1]).

This pass runs last in the fusion phase, on the CUDA profile's kernels: in
each PrimFunc with exactly one reduction block that `pad_einsum` accepts (a
matmul, dense or batched matmul: every read indexed by its loop variables
alone), the rows (a loop only the first operand reads) or the columns (only
the second), where one loop of at least 1,024 iterations that is not a
multiple of 64, are padded to the next multiple of 128 (at most 12.4% more;
6,304 -> 6,400 is 1.5%). Effect on the H200: ViT-S/16 b32's QKV GEMM 46.3 ->
30.2 us, the model 2.205 -> 2.082 ms (results/h200/2026-12-04/). The
padded rows read zeros and are never written out: MetaSchedule inlines the
padding into the shared-memory load (a guarded read) and the copy of the
valid rows into the write-back with its epilogue (a predicate), so a tuned
kernel stays one kernel (tests/passes/test_pad_gemm.py). An untuned one goes
to DLight's Matmul rule, which pads to its own tiles anyway; every padded
kernel of the corpus at batch 32 built with it (results/cpu/2026-12-04/). Convolutions
(windowed reads) are left alone; the padded kernel is a new tuning
workload.

tests/passes/test_pad_gemm.py fails once MetaSchedule's design space tiles
such rows in blocks that do not divide them; the pass can go then.

An implicit GEMM's rows (passes/implicit_gemm.py: a kernel whose GEMM reads
an `im2col` producer block) are padded to a multiple of 128 whenever 128
does not divide them: ResNet-50's 7x7 stage at batch 64 has 3,136 rows,
which only 64-row tiles of our mma.sync schedule divide (~80 us a
convolution where the 128-row tiles take 54-62 us on the other stages,
results/h200/2026-12-04/implicit-gemm-probe/). Those kernels exist only
under `implicit_gemm`, so no committed database loses its records. The
im2col block is then inlined into the padded copy pad_einsum makes of it,
so that the kernel keeps one producer block reading a parameter (the form
passes/mma_gemm.py stages into shared memory).
"""

from __future__ import annotations

import logging

from . import unit_batch
from .implicit_gemm import IM2COL

log = logging.getLogger(__name__)

MIN_EXTENT = 1024  # rows below this are left alone
ALIGNED = 64  # extents that are multiples of this already tile well
MULTIPLE = 128  # pad to this


def pads(rows: int, aligned: int = ALIGNED) -> bool:
    """Whether a GEMM with this many rows (or columns) gets padded (an
    implicit GEMM's with `aligned=MULTIPLE`)."""
    return rows >= MIN_EXTENT and rows % aligned != 0


def padding_for(extents: list[int], roles: list[str], rows_aligned: int = ALIGNED) -> list[int] | None:
    """Per loop, the multiple `pad_einsum` should pad it to (1 = as it is);
    None where nothing needs padding. `roles`: "m" (a loop only the first
    operand reads: the rows), "n" (only the second: the columns), "k" (the
    reduction) or "b" (both: a batch). Rows or columns spread over several
    loops are left alone: DLight's Matmul rule cannot write such a padded
    kernel's output back ("consumers of the cache-write stage that are not
    properly inlined"), and `flat_epilogues(pad_rows=True)` makes a dense
    layer's rows one loop before fusion. Rows that `rows_aligned` divides
    are left as they are (MULTIPLE for an implicit GEMM's rows; columns
    always by ALIGNED)."""
    out = [1] * len(extents)
    for role in ("m", "n"):
        loops = [i for i, r in enumerate(roles) if r == role]
        if len(loops) == 1 and pads(extents[loops[0]], rows_aligned if role == "m" else ALIGNED):
            out[loops[0]] = MULTIPLE
    return out if any(p > 1 for p in out) else None


def pad_prim_func(func):
    """The PrimFunc with its GEMM loops padded, or None where the pass does
    not apply (see the module's docstring)."""
    try:
        return _pad(func)
    except Exception as e:  # noqa: BLE001 - a kernel the pass cannot read is left as it is
        log.debug("pad_gemm: a kernel left as it is (%s)", (str(e).strip().splitlines() or [type(e).__name__])[-1][:120])
        return None


def _pad(func):
    from ..tvm_compat import s_tir, tvm

    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    found = _gemm_loops(sch)
    if found is None:
        return None
    block, extents, roles, im2col = found
    padding = padding_for(extents, roles, MULTIPLE if im2col else ALIGNED)
    if padding is None:
        return None
    _apply(sch, block, padding, roles, im2col)
    return sch.mod["main"]


def row_padding(func, multiple: int, min_rows: int) -> list[int] | None:
    """pad_einsum's padding of this kernel's GEMM rows (one loop, read by
    the first operand alone) to a multiple of `multiple`, where there are at
    least `min_rows` and `multiple` does not divide them; None otherwise
    (passes/mma_gemm.py pads a small GEMM this way inside its schedule)."""
    return tile_padding(func, {"m": multiple}, min_rows)


def tile_padding(func, multiples: dict, min_rows: int, min_cols: int = 1) -> list[int] | None:
    """pad_einsum's padding of this kernel's GEMM loops to multiples of
    `multiples` by role ("m": rows, "n": columns, "k": the reduction; one
    loop of each role padded), where there are at least `min_rows` rows and
    `min_cols` columns and some such loop is not a multiple already; None
    otherwise."""
    from ..tvm_compat import s_tir, tvm

    try:
        found = _gemm_loops(s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0))
    except Exception:  # noqa: BLE001 - not a kernel this reads
        return None
    if found is None:
        return None
    _, extents, roles, _ = found
    if roles.count("m") != 1 or extents[roles.index("m")] < min_rows:
        return None
    if "n" in roles and extents[roles.index("n")] < min_cols:
        return None
    if any(roles.count(role) != 1 for role in multiples):
        return None
    padding = [multiples[r] if r in multiples and e % multiples[r] else 1 for e, r in zip(extents, roles)]
    return padding if any(p > 1 for p in padding) else None


def pad_rows_in(sch, padding: list[int]) -> None:
    """Pad the GEMM of schedule `sch` by `padding` (from row_padding or tile_padding), as
    the schedule's first step: its trace replays onto the kernel."""
    block, _, roles, im2col = _gemm_loops(sch)
    _apply(sch, block, padding, roles, im2col)


def _apply(sch, block, padding, roles, im2col) -> None:
    sch.pad_einsum(block, padding)  # (raises where it cannot)
    if any(pad > 1 for pad, role in zip(padding, roles) if role == "m"):  # (im2col now feeds its padded copy)
        for p in im2col:
            sch.compute_inline(p)


def _gemm_loops(sch):
    """(block, extents, roles, im2col producers) of the schedule's one
    reduction block, a GEMM that pad_einsum takes; None otherwise."""
    from ..tvm_compat import tirx

    reductions = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars):
            reductions.append((block, stmt))
    if len(reductions) != 1:
        return None
    block, stmt = reductions[0]
    if len(stmt.reads) != 2:  # C += A * B (an init block aside)
        return None
    operands = [_loop_vars(region) for region in stmt.reads]
    if any(v is None for v in operands):
        return None  # a windowed read (a convolution): not for pad_einsum
    extents, roles = [], []
    for iv in stmt.iter_vars:
        if not isinstance(iv.dom.extent, tirx.IntImm):
            return None
        extents.append(int(iv.dom.extent))
        in_a, in_b = iv.var in operands[0], iv.var in operands[1]
        roles.append("k" if iv.iter_type == tirx.IterVar.CommReduce
                     else "b" if in_a and in_b else "m" if in_a else "n" if in_b else "b")
    im2col = [p for p in sch.get_producers(block)  # (an implicit GEMM; a [1, M, K] GEMM's 2-D A: unit_batch.py)
              if sch.get(p).name_hint == IM2COL or unit_batch.MARK in sch.get(p).annotations]
    return block, extents, roles, im2col


def _loop_vars(region) -> set | None:
    """The variables a buffer region is indexed by, where each index is one
    variable alone (a point access); None otherwise."""
    from ..tvm_compat import tirx

    out = set()
    for r in region.region:
        if not isinstance(r.min, tirx.Var) or not (isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1):
            return None
        out.add(r.min)
    return out


def pad_gemm_rows():
    """A module pass: see the module's docstring."""
    from . import prim_function_pass

    return prim_function_pass("PadGemmRows", pad_prim_func)
