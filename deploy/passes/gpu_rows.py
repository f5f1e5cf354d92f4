"""A default CUDA schedule of ours for normalizations over short rows
(`ShortRows`): LayerNorm over the channels of an NHWC feature map, or over
the 384 features of a ViT token, and softmax-like kernels of the same shape.

Why our own: such a kernel reduces each of many rows (ConvNeXt-T at batch 32:
100,352 rows of 96 channels) two or more times and then writes the row.
DLight's `GeneralReduction`, which takes it, gives every row a thread block
of 256 threads, so 160 of them idle over a 96-channel row, and launches a
block per row: on the H200 ConvNeXt-T's five LayerNorms took 74 us a call,
11% of their memory roofline
(results/h200/2026-12-04/mma-gemm-design-space/convnext-b32/profile.md).

`ShortRows` gives each row one warp instead: the rows fused and split over
blocks of `ROWS_PER_BLOCK` warps (threadIdx.y), the row's elements over the
warp's 32 lanes (threadIdx.x), each reduction a warp-level all-reduce
(shuffles, no shared-memory round trip between warps) kept in shared memory
for the row's lanes, and the output written by the same lanes, coalesced.

It applies where DLight's GeneralReduction would (the same normalized block
structure: leading spatial axes, trailing reduction axes, every block but the
last a reduction of the same domain, the last injective with the same
iterators in the same order), at most MAX_ROW elements a row and at least
MIN_ROWS rows; anything else is left to GeneralReduction, after it in the
CUDA chain (passes/schedule.py).
"""

from __future__ import annotations

MAX_ROW = 1024  # elements a row: beyond this a block a row (GeneralReduction) keeps more loads in flight
MIN_ROWS = 1024  # below this, too few warps to fill the GPU: GeneralReduction's block a row is fine
ROWS_PER_BLOCK = 4
WARP = 32


class ShortRows:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        import math

        from ..tvm_compat import dlight, s_tir, tirx
        from .kernel_shape import static_int

        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "cuda":
            return None
        sch = s_tir.Schedule(func)
        try:
            infos = dlight.analysis.normalize_prim_func(sch)
            infos = dlight.base.try_inline_contiguous_spatial(sch, infos)
        except Exception:  # noqa: BLE001 - not a kernel DLight can normalize
            return None
        if not infos or len(infos) < 2:
            return None
        dom = infos[0].dom_kind()
        n_s = len(dom) - len(dom.lstrip("S"))
        n_r = len(dom) - len(dom.rstrip("R"))
        if n_s == 0 or n_r == 0 or n_s + n_r != len(dom):
            return None
        if any(b.dom_kind() != dom for b in infos[1:-1]) or not infos[-1].is_injective():
            return None
        last = infos[-1]
        if len(last.dom_kind()) != len(dom):
            return None
        extents = [static_int(it.dom) for it in infos[0].iters]
        last_extents = [static_int(it.dom) for it in last.iters]
        if None in extents or extents != last_extents:
            return None
        rows, row = math.prod(extents[:n_s]), math.prod(extents[n_s:])
        if row > MAX_ROW or rows < MIN_ROWS or rows % ROWS_PER_BLOCK:
            return None
        # the last block's loops must already be in the reductions' order
        # (GeneralReduction reorders them; we leave such kernels to it)
        loops = sch.get_loops(last.block_rv)
        if len(loops) != len(dom):
            return None
        try:
            return _schedule(sch, infos, n_s, n_r, extents)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None


def _flatten(sch, block, n_s: int, extents: list[int]) -> None:
    """The block's iterators as [row, element]: the leading n_s fused into one
    row index, the rest into one element index, so that splitting the rows
    over warps keeps each warp's region one row (with the axes only fused,
    compute-at found 4 rows a warp)."""
    from ..tvm_compat import tirx

    def row_major(idx, dims):
        out = idx[0]
        for i, d in zip(idx[1:], dims[1:]):
            out = out * d + i
        return out

    def f(*idx):
        return [row_major(idx[:n_s], extents[:n_s]), row_major(idx[n_s:], extents[n_s:])]

    sch.transform_block_layout(block, tirx.IndexMap.from_func(f, ndim=len(extents)))


def _flatten_rows_buffer(sch, block) -> None:
    """A reduction's output ([rows...], as its buffer is shaped: with the
    unit axes DLight's normalization leaves out of the iterators) as one row
    axis."""
    from .kernel_shape import static_int

    shape = [static_int(d) for d in sch.get(block).writes[0].source.shape]

    def f(*idx):
        out = idx[0]
        for i, d in zip(idx[1:], shape[1:]):
            out = out * d + i
        return [out]

    sch.transform_layout(block, ("write", 0), f)


def _schedule(sch, infos, n_s: int, n_r: int, extents: list[int]):
    for info in infos:
        _flatten(sch, info.block_rv, n_s, extents)
    for info in infos[:-1]:
        _flatten_rows_buffer(sch, info.block_rv)
    n_s = n_r = 1
    last = infos[-1].block_rv
    loops = sch.get_loops(last)
    fused_rows = sch.fuse(*loops[:n_s])
    bx, ty = sch.split(fused_rows, [None, ROWS_PER_BLOCK])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    r_loop = sch.fuse(*sch.get_loops(last)[-n_r:])
    r_loop, tx = sch.split(r_loop, [None, WARP])
    sch.reorder(tx, r_loop)
    sch.bind(tx, "threadIdx.x")
    for info in reversed(infos[:-1]):
        block = info.block_rv
        for i, _ in enumerate(sch.get(block).writes):
            sch.set_scope(block, buffer_index=i, storage_scope="local")
        sch.compute_at(block, ty, preserve_unit_loops=True)
        r = sch.fuse(*sch.get_loops(block)[-n_r:])
        r, tx_r = sch.split(r, [None, WARP])
        sch.reorder(tx_r, r)
        sch.bind(tx_r, "threadIdx.x")
    return sch
