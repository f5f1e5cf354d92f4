"""The CPU schedule of normalizations (layer, group and instance norms,
softmax, means): their statistics computed once each, vectorized, where
DLight's CPU `Reduction` rule took them.

DLight's rule fuses the leading spatial loops of the kernel's last block,
runs them in parallel, and computes every other block under them, a row at
a time, its reductions as scalar loops. Two ways that loses on the CPU:

- Statistics broadcast over more than a row are recomputed for every row.
  An instance norm in the NCHWc layout: the mean of [1, 4, 128, 128, 16] is
  [1, 4, 1, 1, 16], and under the last block's fused 4 x 128 rows the whole
  16,384-pixel sum was recomputed for each of the 128 rows: GroupNorm-Net's
  first instance norm took 37-39 ms of the model's 117 ms on 2 cores
  (0.2 GB/s), 0.19 ms here.
- A reduction over a row's contiguous axis runs as one scalar chain (LLVM
  does not reorder a float sum into vectors), and a mean over a
  non-contiguous axis (MLP-Mixer's mean over tokens) walks the memory
  across: ConvNeXt-T's first layer norm (96 channels, 56 x 56 pixels)
  0.23-0.45 ms, here 0.08; ViT-S/16's softmax 0.35-0.59 ms, here 0.16.

This rule takes DLight's kernels whose reductions are sums or maxima over
plain elements (no window: average pools stay with DLight, 1.6x faster
there), and any whose statistics DLight would recompute (`takes`), and
schedules each block at the root, once:

- an elementwise block read by one block is inlined into it where TVM
  allows (a mean's division into the subtraction, the square into the
  variance's sum); one read by several (a softmax's exponentials, read by
  the sum and the division) is computed once, at the root;
- a reduction whose output's contiguous axis is spatial, and the input's
  too (the 16 channels of a NCHW16c block, a mean over tokens), takes it as
  the vector: the window is reduced outside it, the vector accumulators in
  registers (a local cache), its other spatial axes in parallel;
- a reduction over its contiguous axis is split into `lanes()` partial
  results (rfactor), a vector, then combined, its spatial axes in parallel;
- the other blocks (the normalization itself) run over the whole output in
  parallel and vectorized, as `InjectiveParallel` runs them.

Measured per kernel over the corpus, and the models:
`results/cpu/2026-12-07/statistics/`. `tests/passes/test_cpu_reduction.py`
fails once DLight's rule stops recomputing broadcast statistics.
"""

from __future__ import annotations

import math

from .cpu_default import (
    PARALLEL_MIN_WORK,
    inline_single_readers,
    lanes,
    largest_divisor,
    parallel_vectorized,
    vector_axis,
)
from .kernel_shape import static_int, vars_of

MIN_PARTIALS = 4  # a sum over a contiguous axis is split into this many partial sums or more, else left scalar


def _infos(sch):
    from ..tvm_compat import dlight

    try:
        return dlight.analysis.normalize_prim_func(sch)
    except Exception:  # noqa: BLE001 - not a kernel DLight's analysis reads: not ours
        return None


def _leading_spatial(info) -> int:
    kinds = info.dom_kind()
    return len(kinds) - len(kinds.lstrip("S"))


def recomputed(infos) -> bool:
    """Whether DLight's CPU Reduction rule, given this kernel, would compute
    one of its blocks under loops that block does not vary along: some
    block's leading spatial extents differ from those of the last block,
    whose leading loops it fuses and runs the others under."""
    n = min(_leading_spatial(i) for i in infos)
    last = [static_int(it.dom) for it in infos[-1].iters[:n]]
    return any([static_int(it.dom) for it in i.iters[:n]] != last for i in infos[:-1])


def _is_sum(block) -> bool:
    """Whether a reduction block adds to its output (`y = y + x`) (node types
    by name: TVM 0.27's load node is a `TensorLoad`, its buffer `.source`)."""
    body, out = block.body, block.writes[0].source
    if type(body).__name__ != "BufferStore" or not body.buffer.same_as(out) or type(body.value).__name__ != "Add":
        return False
    return any(type(x).__name__ in ("BufferLoad", "TensorLoad") and x.source.same_as(out)
               for x in (body.value.a, body.value.b))


def takes(sch, infos) -> bool:
    """DLight's CPU Reduction's preconditions (a reduction, an injective
    last block, every block's first axis spatial), reductions that read
    each element once (no window), and either every reduction a sum or a maximum or
    statistics DLight would recompute (`recomputed`)."""
    if infos is None or len(infos) < 2 or all(i.is_injective() for i in infos) or not infos[-1].is_injective():
        return False
    if any(not i.dom_kind() or i.dom_kind()[0] != "S" for i in infos):
        return False
    reductions = [sch.get(i.block_rv) for i in infos if not i.is_injective()]
    if not all(_reads_each_element_once(b) for b in reductions):
        return False
    return all(_is_sum(b) or _is_max(b) for b in reductions) or recomputed(infos)


def _is_max(block) -> bool:
    """Whether a reduction block keeps a maximum (`y = max(y, x)`)."""
    return type(block.body).__name__ == "BufferStore" and type(block.body.value).__name__ == "Max"


def _reads_each_element_once(block) -> bool:
    """Whether every index the block reads is one loop variable or a
    constant: statistics, not a window (a pooling's `oh * 2 + kh`). DenseNet's
    average pools were 1.6x slower under this rule than under DLight's."""
    from ..tvm_compat import tirx

    return all(isinstance(rg.min, tirx.Var) or static_int(rg.min) is not None for r in block.reads for rg in r.region)


class SumStatistics:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        from ..tvm_compat import dlight, s_tir, target_codegen, tirx

        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        infos = _infos(sch)
        if not takes(sch, infos):
            return None
        bits = target_codegen.llvm_get_vector_width(target)
        inline_single_readers(sch, [i.block_rv for i in infos[:-1] if i.is_injective()])
        for block in sch.get_child_blocks(dlight.analysis.get_root_block(sch)):
            if any(iv.iter_type != tirx.IterVar.DataPar for iv in sch.get(block).iter_vars):
                _reduction(sch, block, bits)
            else:
                parallel_vectorized(sch, block, bits)  # the normalization itself, as InjectiveParallel runs it
        return sch


def _reduction(sch, block, bits: int) -> None:
    """One reduction block at the root: its spatial loops then its reduction
    loops (normalize_prim_func's order), vectorized along its output's
    contiguous axis where the input is contiguous along it too, else in
    partial sums of its innermost reduction loop."""
    from ..tvm_compat import tirx

    stmt = sch.get(block)
    loops = sch.get_loops(block)
    kinds = [iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars]
    extents = [static_int(sch.get(lp).extent) for lp in loops]
    if len(loops) != len(kinds) or None in extents or kinds != sorted(kinds, reverse=True):
        return  # not the loop nest normalize_prim_func leaves: TVM's lowering as it is
    n_s = sum(kinds)
    n = lanes(bits, stmt.writes[0].source.dtype.bits)
    parallel = math.prod(extents) >= PARALLEL_MIN_WORK
    write = stmt.writes[0]
    v = vector_axis(write, [iv.var for iv in stmt.iter_vars[:n_s]], extents)
    if v is not None and extents[v] > 1 and any(stmt.iter_vars[v].var in vars_of(r.region[-1].min) for r in stmt.reads):
        vec = largest_divisor(extents[v], n)
        o, vi = sch.split(loops[v], factors=[None, vec])
        outer = [lp for i, lp in enumerate(loops[:n_s]) if i != v] + [o]
        sch.reorder(*outer, *loops[n_s:], vi)
        tile = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if parallel:
            sch.parallel(tile)
        acc = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(acc, tile, preserve_unit_loops=True)
        if vec > 1:
            sch.vectorize(vi)
        init = sch.decompose_reduction(block, loops[n_s])
        if vec > 1:
            sch.vectorize(sch.get_loops(init)[-1])
            sch.vectorize(sch.get_loops(acc)[-1])
        return
    # over its contiguous axis: partial sums of the innermost reduction loop, a vector of them (or the largest
    # divisor of the loop up to one, at least MIN_PARTIALS), then their sum
    part = largest_divisor(extents[-1], n)
    if part < MIN_PARTIALS or extents[-1] < 2 * part:
        if n_s and parallel:
            sch.parallel(sch.fuse(*loops[:n_s]) if n_s > 1 else loops[0])
        return
    _, ri = sch.split(loops[-1], factors=[None, part])
    rf = sch.rfactor(ri, len(write.region))  # (rfactor leaves the original loops to the sum of the partial sums)
    rf_loops = sch.get_loops(rf)
    if n_s:
        tile = sch.fuse(*rf_loops[:n_s]) if n_s > 1 else rf_loops[0]
        if parallel:
            sch.parallel(tile)
        sch.reverse_compute_at(block, tile, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(rf)[-1])
    init = sch.decompose_reduction(rf, sch.get_loops(rf)[1 if n_s else 0])
    sch.vectorize(sch.get_loops(init)[-1])
