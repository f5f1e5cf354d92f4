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
(shuffles, no shared memory) whose result every lane keeps in a register,
and the output written by the same lanes, coalesced.

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
            return _schedule(sch, infos, n_s, extents)
        except Exception:  # noqa: BLE001 - a ScheduleError: not this rule's kernel
            return None


def _row_major(idx, dims):
    """The flat index of `idx` in an array of shape `dims`."""
    out = idx[0]
    for i, d in zip(idx[1:], dims[1:]):
        out = out * d + i
    return out


def _flatten(sch, block, n_s: int, extents: list[int]) -> None:
    """The block's iterators as [row, element]: the leading n_s fused into one
    row index, the rest into one element index, so that compute-at finds a
    warp's region to be one row (through the fused axes' div and mod it
    found 3,136 rows of ConvNeXt's LayerNorm)."""
    from ..tvm_compat import tirx

    def f(*idx):
        return [_row_major(idx[:n_s], extents[:n_s]), _row_major(idx[n_s:], extents[n_s:])]

    sch.transform_block_layout(block, tirx.IndexMap.from_func(f, ndim=len(extents)))


def _flatten_rows_buffer(sch, block) -> None:
    """A reduction's output ([rows...], as its buffer is shaped: with the
    unit axes DLight's normalization leaves out of the iterators) as one row
    axis."""
    from .kernel_shape import static_int

    shape = [static_int(d) for d in sch.get(block).writes[0].source.shape]
    sch.transform_layout(block, ("write", 0), lambda *idx: [_row_major(idx, shape)])


def _schedule(sch, infos, n_s: int, extents: list[int]):
    for info in infos:
        _flatten(sch, info.block_rv, n_s, extents)
    for info in infos[:-1]:
        _flatten_rows_buffer(sch, info.block_rv)
    last = infos[-1].block_rv
    rows, elements = sch.get_loops(last)
    bx, ty = sch.split(rows, [None, ROWS_PER_BLOCK])
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    elements, tx = sch.split(elements, [None, WARP])
    sch.reorder(tx, elements)
    sch.bind(tx, "threadIdx.x")
    for info in reversed(infos[:-1]):  # each reduction a warp's, computed for the row its warp writes
        block = info.block_rv
        for i in range(len(sch.get(block).writes)):
            sch.set_scope(block, buffer_index=i, storage_scope="local")
        sch.compute_at(block, ty, preserve_unit_loops=True)
        r, tx_r = sch.split(sch.get_loops(block)[-1], [None, WARP])
        sch.reorder(tx_r, r)
        sch.bind(tx_r, "threadIdx.x")
    return sch
