"""The default CPU schedule of a contraction: what an untuned convolution or
matmul kernel gets on the `llvm` target.

TVM 0.27 has no default CPU schedule for these: DLight's CPU rules cover
GEMV and row reductions (softmax, norms), and its `Reduction` rule, which
takes every convolution when nothing else does, parallelizes the output and
runs each output element's whole reduction as a scalar loop. Untuned
ResNet-50 took 13.6 s per batch of 2 that way on this project's CPU machine.

This rule is the classic direct schedule of a contraction (what TOPI's x86
schedules did before MetaSchedule), derived from the kernel's own loops, so
it applies to any layout:

- the output's contiguous axis `v` is the vector axis: its inner part (the
  largest divisor of its extent up to the target's vector lanes) runs as one
  SIMD vector;
- one more spatial axis `b`, one that the vector-loaded operand does not
  index (a convolution's output channels, a matmul's rows), is blocked by up
  to 8, so each vector load of that operand serves `b` accumulators held in
  registers (a local cache written back once); where registers are left
  (MAX_ACCUMULATORS vectors), an axis that operand does index (NCHWc's outer
  output channels) is blocked too, so each broadcast value of the other
  operand feeds a 2-D tile of accumulators (ResNet-50 NCHW16c, untuned:
  33.0 -> 27.0 ms on 2 cores); without such a second axis, the first takes
  up to every accumulator; where blocks of 8 would leave much of an axis's
  last tile empty, a divisor up to the accumulators' room blocks it instead
  (SqueezeNet's 13-pixel rows: 13, not 8 and a predicated 5; its classifier
  1.7-2.1x faster), and a second block that would (EfficientNet's 7 blocks
  of output channels by 2) is dropped for a longer first
  (`WHOLE_BLOCKS`, `results/cpu/2026-12-07/whole-blocks/`);
- a vector axis the tile does not divide (ViT's 197 keys) is padded to
  whole tiles (`_pad`: the operands copied with zeros, the result cropped),
  since a tile ending in a predicate is not vectorized; a blocked axis too
  where that costs little (MAX_WASTE, PAD_BLOCKED_MIN_K);
- the reduction loops run inside each tile, and the tiles of the remaining
  spatial axes are fused and run in parallel on every core;
- injective producers (padding) run before it in parallel (a max
  pooling's are read in place); injective consumers (bias, activation,
  residual add) are applied as each tile is written back, and one that
  cannot be (squeeze-excitation's multiply, broadcast over the feature map)
  runs after the tiles, on whole vectors where its rows are
  (`VECTOR_EPILOGUE`: MobileNetV3's such kernels 8x faster,
  `results/cpu/2026-12-07/vector-epilogue/`).

It replaces DLight's CPU GEMV rule in the chain. GEMV scheduled
squeeze-excitation's small 1x1 convolutions ~20% faster (0.01 to 0.2 ms
each), but its schedule of one of them (48 -> 1152 channels, then sigmoid
and a multiply broadcast over 7x7) does not compile: LLVM was still at it
after minutes, EfficientNet-B0's build took 19 minutes, and the CPU kernel
check hung on the same kernel. A compile that never ends is not a failure
the schedule chain can fall back from, so GEMV is out.
`tests/passes/test_cpu_default.py` fails once TVM compiles it; then GEMV may
come back after this rule.

It applies to a kernel with exactly one reduction block of two operands or
more, or of one whose maximum (minimum) is taken (a max pooling, `POOLS`:
TVM's plain lowering ran those on one core; SqueezeNet's three 0.21 -> 0.08
ms, `results/cpu/2026-12-07/pools/`), whose loops are its spatial axes
followed by its reduction axes, and only injective blocks besides; anything
else is left to DLight's CPU rules and TVM's default.
Measured over the corpus: `results/cpu/2026-12-02/corpus-llvm-default/`.

`InjectiveParallel`, last in the CPU chain, takes the kernels without any
reduction (elementwise ops, transposes, concatenation, padding): each
block's outer loops in parallel, the innermost vectorized.
"""

from __future__ import annotations

import math

from .kernel_shape import rule_kernel, single_reduction, static_int, vars_of
from .mma_gemm import is_multiply_accumulate

LANES_BITS_FALLBACK = 128
PARALLEL_MIN_ELEMENTS = 4096  # below this a parallel launch costs more than the loop (elements written)
PARALLEL_MIN_WORK = 1 << 16  # multiply-adds: below this a parallel launch costs more than the kernel
MAX_BLOCK = 8
MAX_ACCUMULATORS = 16  # vector registers held by one tile's accumulators
PAD = True  # a kernel whose tile does not divide an axis padded to whole tiles (`_pad`); False: predicated tiles
MAX_WASTE = 0.125  # a blocked axis is padded only where that adds at most this share of work (a vector axis always)
PAD_BLOCKED_MIN_K = 128  # ... and where each output sums at least this many products (ViT's GEMMs, not a 1x1 conv)
WHOLE_BLOCKS = True  # blocks that divide their axis up to the accumulators' room, no mostly empty second block (`_plan`)
VECTOR_EPILOGUE = True  # an epilogue left after the tiles runs on whole vectors where it can; False: left to LLVM
POOLS = True  # max (and min) poolings tiled as contractions are; False: left to TVM's plain lowering
WINDOW_PADDING = True  # a depthwise convolution reads its padding in place, as a pooling does (`_window_only`)
CONTIGUOUS_WRITES = True  # an injective block's loop along its output's last axis innermost (`_contiguous_writes`)
INLINE = True  # InjectiveParallel inlines each block read by one other block into it; False: every block at the root


def lanes(bits: int, dtype_bits: int) -> int:
    """Elements of `dtype_bits` in one vector of the target's `bits` (LLVM's
    vector width; 0 where it does not say), at least 2."""
    return max(2, (bits if bits > 0 else LANES_BITS_FALLBACK) // dtype_bits)


def largest_divisor(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)


def _block(n: int, limit: int, cap: int = 0) -> int:
    """The block of an axis of extent `n`: its largest divisor up to
    `limit`; where none reaches half of it and whole blocks of `limit` would
    add more than MAX_WASTE of work, the largest divisor up to `cap` (the
    accumulators' room) if that one does (WHOLE_BLOCKS: 13 pixels a row
    blocked by 13, not 8 and a predicated 5; 1599 steps still by 8, the last
    tile 7: there the smaller whole tile was 9% slower); else `limit`
    itself, the axis then padded to whole blocks (`_pad`) or its last tile
    cut short by a predicate (ViT's 197 tokens: a prime)."""
    d = largest_divisor(n, limit)
    if n <= limit or 2 * d > limit:
        return d
    wide = largest_divisor(n, cap) if WHOLE_BLOCKS and cap and _waste(n, limit) > MAX_WASTE else 0
    return wide if 2 * wide > limit else limit


class ContractionTiling:
    """A DLight-style rule (`apply(func, target, tunable)` returns a
    schedule, or None where it does not apply)."""

    def apply(self, func, target, _tunable=False):
        from ..tvm_compat import target_codegen

        got = rule_kernel(func, target, "llvm")
        if got is None:
            return None
        sch, (main, producers, consumers, n_s, extents) = got
        bits = target_codegen.llvm_get_vector_width(target)
        plan = _plan(sch, main, n_s, extents, bits)
        if plan is None:
            return None
        padded = None
        # the vector axis made whole (its predicate keeps the tile scalar); a blocked axis where that wastes little
        # and each output sums enough products to pay for the copies
        blocked_ok = math.prod(extents[n_s:]) >= PAD_BLOCKED_MIN_K
        ragged = [(i, f) for i, f in zip(plan[::2], plan[1::2]) if i is not None and f > 1 and extents[i] % f
                  and (i == plan[0] or (blocked_ok and _waste(extents[i], f) <= MAX_WASTE))]
        block = sch.get(main.block_rv)
        # (only `C + x * y`: zeros padded into another body might be divided by, and integer division faults)
        if PAD and ragged and is_multiply_accumulate(block.body, block.writes[0].source):
            padded = _pad(func, ragged, bits)
            if padded is not None:
                sch, (main, producers, consumers, n_s, extents), plan = padded
        v, vec, b, blk, b2, blk2 = plan
        block = sch.get(main.block_rv)
        write = block.writes[0]

        # Consumers: fold the chain into its last block, applied at write-back.
        for c in consumers[:-1]:
            sch.compute_inline(c.block_rv)
        out = consumers[-1].block_rv if consumers else None

        loops = sch.get_loops(main.block_rv)
        outer, inner = [], []
        for i in range(n_s):
            if i == v:
                o, vi = sch.split(loops[i], factors=[None, vec])
                outer.append(o)
                v_inner = vi
            elif (i == b and blk > 1) or (i == b2 and blk2 > 1):
                o, bi = sch.split(loops[i], factors=[None, blk if i == b else blk2])
                outer.append(o)
                inner.append(bi)
            else:
                outer.append(loops[i])
        inner.append(v_inner)
        sch.reorder(*outer, *loops[n_s:], *inner)
        tile = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if math.prod(extents) >= PARALLEL_MIN_WORK:  # a tiny kernel stays on the calling thread (TVM's pool never wakes)
            sch.parallel(tile)

        writeback = sch.cache_write(main.block_rv, 0, "local")
        sch.reverse_compute_at(writeback, tile, preserve_unit_loops=True)
        if out is not None:
            # (padded: the epilogue reads the padded result through the crop, whatever its own shape)
            inlined = False
            if padded is None and _over_product(sch.get(out), write.source):
                try:
                    sch.reverse_compute_inline(out)
                    inlined = True
                except Exception:  # noqa: BLE001 - it reads the product other than one to one (a transpose)
                    pass
            if not inlined:  # a broadcast epilogue (squeeze-excitation's multiply), or a padded kernel's: after the tiles
                if not (VECTOR_EPILOGUE and parallel_vectorized(sch, out, bits, whole=True)):
                    _parallel_at_root(sch, out)
        for i in inner[:-1]:
            sch.unroll(i)
        sch.vectorize(v_inner)
        init = sch.decompose_reduction(main.block_rv, loops[n_s])
        sch.vectorize(sch.get_loops(init)[-1])
        sch.vectorize(sch.get_loops(writeback)[-1])

        in_place = len(block.reads) < 2 or (WINDOW_PADDING and _window_only(block, main, n_s, v, extents))
        for p in producers:
            if in_place:  # (a pooling's padding read in place: a copy of the input at the root ran 2-3x slower)
                try:
                    sch.compute_inline(p.block_rv)
                    continue
                except Exception:  # noqa: BLE001 - TVM declines: at the root, as a contraction's
                    pass
            _parallel_at_root(sch, p.block_rv)
        return sch


def _plan(sch, main, n_s: int, extents: list[int], bits: int):
    """(v, vec, b, blk, b2, blk2): the vector axis and its vector, the
    blocked axis and its block, the second blocked axis and its block (None,
    1 where there is none); None where the rule does not apply."""
    block = sch.get(main.block_rv)
    # two operands, or (POOLS) one whose maximum or minimum is taken: a max pooling's window
    if len(block.writes) != 1 or len(block.reads) < 2 and not (POOLS and _extremum(block)):
        return None
    write = block.writes[0]
    spatial = main.iters[:n_s]

    v = vector_axis(write, [it.var for it in spatial], extents)
    if v is None or extents[v] < 2:
        return None
    n = lanes(bits, write.source.dtype.bits)
    # Two vectors per row of the tile where the axis divides evenly (a
    # matmul's output columns: each broadcast of the other operand then
    # feeds two accumulators, as in a GEMM micro-kernel).
    vec = 2 * n if extents[v] % (2 * n) == 0 else _block(extents[v], n)
    if vec < 2:
        return None
    # The blocked axis: not indexed by the operand read along the vector axis.
    vloaded = [r for r in block.reads if any(spatial[v].var in vars_of(rg.min) for rg in r.region)]
    used = set().union(*(vars_of(rg.min) for r in vloaded for rg in r.region)) if vloaded else set()
    registers = -(-vec // n)
    cap = MAX_ACCUMULATORS // registers
    b = next((i for i in reversed(range(n_s)) if i != v and extents[i] > 1 and spatial[i].var not in used), None)
    # A second blocked axis, one the vector-loaded operand does index (a
    # blocked layout's outer output channels): each broadcast value of the
    # other operand then serves more accumulators.
    # (Not an axis the other operands index too, as a batch matmul's
    # batch: blocking it would reuse nothing.)
    others = set().union(*(vars_of(rg.min) for r in block.reads if r not in vloaded for rg in r.region))
    b2 = next((i for i in reversed(range(n_s)) if i not in (v, b) and extents[i] > 1 and spatial[i].var in used
               and spatial[i].var not in others), None)
    # Without a second one (WHOLE_BLOCKS), the first takes up to every accumulator (55 pixels a row: 11, not 5).
    limit = cap if WHOLE_BLOCKS and b2 is None else min(MAX_BLOCK, cap)
    blk = 1 if b is None else _block(extents[b], max(1, limit), cap)
    room = cap // blk
    blk2 = _block(extents[b2], room, room) if b2 is not None and room >= 2 else 1
    if WHOLE_BLOCKS and b is not None and b2 is not None and _waste(extents[b2], blk2) > MAX_WASTE:
        # a second block whose last tile would be mostly empty (EfficientNet's 7 blocks of output channels by 2):
        # none, the first taking every accumulator instead (its 1x1 projections 1.6-1.9x faster)
        b2, blk2 = None, 1
        blk = _block(extents[b], max(1, cap), cap)
    if blk2 == 1:
        b2 = None
    return v, vec, b, blk, b2, blk2


def _window_only(block, main, n_s: int, v: int, extents: list[int]) -> bool:
    """Whether a contraction sums over a small 2-D window alone (a depthwise
    convolution: no input channels in its reduction) with its vector along
    an axis the window does not slide on (NCHW16c's channels), so that its
    padding, read in place under a predicate that is the same for a whole
    vector, costs less than a padded copy of its input at the root:
    MobileNetV2's 10 depthwise kernels 0.23-0.78x the time
    (results/cpu/2026-12-08/window-padding/). A stem's 3 channels x 3 x 3
    was 1.2x slower so, ConvNeXt's NCHW 7x7 depthwise (vectors along the
    row it slides on) 4-7x."""
    reduction = extents[n_s:]
    if len(reduction) != 2 or math.prod(reduction) > 25:
        return False
    vector = main.iters[v].var
    window = {it.var for it in main.iters[n_s:]}
    return not any(vector in vars_of(rg.min) and window & vars_of(rg.min) for r in block.reads for rg in r.region)


def _extremum(block) -> bool:
    """`C[...] = max(C[...], x)` (or min): a max pooling's update."""
    body = block.body
    return type(body).__name__ == "BufferStore" and type(body.value).__name__ in ("Max", "Min")


def vector_axis(write, spatial_vars, extents: list[int]) -> int | None:
    """The vector axis of a reduction block: the position among its spatial
    axes (`spatial_vars`, their `extents`) of the one that indexes the
    output's last index of more than one element (an SE block's
    [1, C, 1, 1]: the channels); None where that index is no spatial axis."""
    for rg in reversed(write.region):
        if static_int(rg.extent) == 1 and not any(x.same_as(rg.min) and e > 1 for x, e in zip(spatial_vars, extents)):
            continue
        return next((i for i, x in enumerate(spatial_vars) if x.same_as(rg.min)), None)
    return None


def inline_single_readers(sch, blocks) -> None:
    """Each of `blocks` (elementwise) read by exactly one other block inlined
    into it, where TVM allows: not into a concatenation (`_selects`), not
    where bools are involved (`_touches_bool`); the others stay at the root."""
    for block in blocks:
        consumers = sch.get_consumers(block)
        if len(consumers) == 1 and not _touches_bool(sch.get(block)) and not _selects(sch.get(consumers[0])):
            try:
                sch.compute_inline(block)
            except Exception:  # noqa: BLE001 - TVM declines (an output of the kernel): left at the root
                pass


def _over_product(epilogue, product) -> bool:
    """Whether the epilogue's last block runs over the product's elements
    one to one: it writes the product's shape, or it iterates over it while
    it writes another (a packed GEMM's epilogue iterates the panels and
    writes the kernel's [.., N] output: passes/pack_weights.py). Unit axes
    are not iterated, so they are left out of that comparison."""
    shape = [static_int(d) for d in product.shape]
    if [static_int(d) for d in epilogue.writes[0].source.shape] == shape:
        return True
    return [e for e in (static_int(iv.dom.extent) for iv in epilogue.iter_vars) if e != 1] == [d for d in shape if d != 1]


def _waste(n: int, block: int) -> float:
    """The share of extra work padding `n` to whole blocks adds."""
    return (-(-n // block) * block - n) / n


def _pad(func, ragged, bits: int):
    """The kernel with the axes its tile does not divide (`ragged`: (axis,
    block) pairs) padded to whole tiles by TVM's `pad_einsum`: copies of its
    operands padded with zeros, the contraction over whole tiles, and the
    result cropped from the padded one. A vector axis that ends in a
    predicate keeps LLVM from vectorizing the tile: ViT's attention scores
    (197 x 197 a head), whose vector axis is the 197 keys, ran at 10
    GFLOP/s and took 3.04 ms a call on 2 cores, padded 0.20 ms
    (results/cpu/2026-12-07/corpus-llvm-pad/). A blocked axis (unrolled) is
    padded where that adds at most MAX_WASTE of work and each output sums
    PAD_BLOCKED_MIN_K products or more (197 rows to 200: 0.61 -> 0.41 ms on
    a 197 x 384 x 384 matmul; 9 rows to 16 was slower, and so were
    ShuffleNet's 1x1 convolutions of 24 and 58 channels with their 58 output
    channels padded to 64, 0.74x-0.94x), else left to its predicate.

    (schedule, single_reduction, plan) of the padded kernel, or None where
    pad_einsum declines it (a blocked layout's convolution) or the padded
    kernel's vector axis is not whole."""
    from ..tvm_compat import s_tir

    sch = s_tir.Schedule(func)
    found = single_reduction(sch)
    if found is None:
        return None
    main, _, _, n_s, extents = found
    padding = [1] * len(extents)
    for i, f in ragged:
        padding[i] = f
    try:
        sch.pad_einsum(main.block_rv, padding)
    except Exception:  # noqa: BLE001 - pad_einsum declined: tiles cut short by predicates instead
        return None
    found = single_reduction(sch)
    if found is None:
        return None
    main, _, _, n_s, extents = found
    plan = _plan(sch, main, n_s, extents, bits)
    if plan is None or extents[plan[0]] % plan[1]:
        return None
    return sch, found, plan


def _parallel_at_root(sch, block) -> None:
    """An injective block left at the root: its outer loops fused and run in
    parallel, the innermost loop left to LLVM."""
    loops = sch.get_loops(block)
    if math.prod(static_int(sch.get(lp).extent) or PARALLEL_MIN_ELEMENTS for lp in loops) < PARALLEL_MIN_ELEMENTS:
        return
    if len(loops) > 1:
        sch.parallel(sch.fuse(*loops[:-1]))
    elif loops:
        sch.parallel(loops[0])



class InjectiveParallel:
    """The default CPU schedule of a kernel without a reduction (elementwise
    ops, layout changes, concatenation, padding, resizing): each block read
    by one other block inlined into it (`INLINE`), then each remaining
    block's outer loops fused and run on every core, its innermost loop
    vectorized where its extent allows. TVM's own lowering runs these on one
    core as plain loops. Without the inlining every block of a fused chain
    wrote its intermediate, and a reshape's index arithmetic kept the blocks
    after it scalar: ConvNeXt-T's GELUs (seven blocks each) took 0.84 ms on
    its first two stages' [3136, 384] and [784, 768], 0.25 and 0.14 ms
    inlined (results/cpu/2026-12-07/inline-elementwise/). A block read by two
    is left at the root (computed once), as is one read by a concatenation
    (`_selects`) or touching bools (`_touches_bool`)."""

    def apply(self, func, target, _tunable=False):
        from ..tvm_compat import dlight, s_tir, target_codegen, tirx

        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        try:
            blocks = sch.get_child_blocks(dlight.analysis.get_root_block(sch))
        except Exception:  # noqa: BLE001 - not a plain root block: not ours
            return None
        if not blocks or any(iv.iter_type != tirx.IterVar.DataPar for b in blocks for iv in sch.get(b).iter_vars):
            return None
        if INLINE:
            inline_single_readers(sch, blocks[:-1])
            blocks = sch.get_child_blocks(dlight.analysis.get_root_block(sch))
        bits = target_codegen.llvm_get_vector_width(target)
        for block in blocks:
            if not parallel_vectorized(sch, block, bits):
                return None
        return sch


def parallel_vectorized(sch, block, bits: int, whole: bool = False) -> bool:
    """An injective block at the root: its innermost loop split by the
    largest divisor up to a vector and vectorized (not where it touches
    bools, `_touches_bool`), its outer loops fused and run in parallel where
    it writes PARALLEL_MIN_ELEMENTS or more; False (nothing done) where a
    loop's extent is not static, or with `whole` where the innermost loop is
    not whole vectors (NCHW16c's 16 channels are; Swin's 49 tokens are not,
    and vectors of 7 ran them 1.2-1.4x slower than LLVM's own loop)."""
    loops = sch.get_loops(block)
    extents = [static_int(sch.get(lp).extent) for lp in loops]
    if not loops or any(e is None for e in extents):
        return False
    stmt = sch.get(block)
    if CONTIGUOUS_WRITES and not whole and _contiguous_writes(sch, block, loops):  # (whole: nothing done if False)
        loops = sch.get_loops(block)
        extents = [static_int(sch.get(lp).extent) for lp in loops]
    dtype_bits = max(8, stmt.writes[0].source.dtype.bits) if stmt.writes else 32
    if whole and extents[-1] % lanes(bits, dtype_bits):
        return False
    inner, outer = loops[-1], list(loops[:-1])
    vec = largest_divisor(extents[-1], lanes(bits, dtype_bits))
    if 2 <= vec < extents[-1]:
        o, inner = sch.split(inner, factors=[None, vec])
        outer.append(o)
    if outer and math.prod(extents) >= PARALLEL_MIN_ELEMENTS:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    if vec >= 2 and not _touches_bool(stmt):
        sch.vectorize(inner)
    return True


def _contiguous_writes(sch, block, loops) -> bool:
    """Make the loop along the last axis of the block's output its innermost
    (the vectorized one), where another is: a layout change iterates over its
    input, so NCHW16c to NCHW wrote each vector of 16 channels to 16 planes a
    plane apart, and NCHW to NCHW16c (output axis `c % 16`, whose loop is
    split by 16 first) wrote each channel's row into 16-float strides, plane
    after plane. With the writes contiguous, the reads gather instead, from
    lines the next iterations read too: U-Net's 10 layout changes 9.9 ->
    2.0 ms a run, its package 0.93x (results/cpu/2026-12-08/contiguous-writes/).
    True where the loops changed."""
    from ..tvm_compat import tirx

    stmt = sch.get(block)
    realize = sch.get(loops[-1]).body if loops else None
    if len(stmt.writes) != 1 or not hasattr(realize, "iter_values"):
        return False
    last, factor = stmt.writes[0].region[-1].min, 0
    if isinstance(last, tirx.FloorMod) and isinstance(last.b, tirx.IntImm):
        last, factor = last.a, int(last.b.value)
    bound = {iv.var: v for iv, v in zip(stmt.iter_vars, realize.iter_values)}.get(last) \
        if isinstance(last, tirx.Var) else None
    j = next((j for j, lp in enumerate(loops) if bound is not None and sch.get(lp).loop_var.same_as(bound)), None)
    if j is None:
        return False
    inner = loops[j]
    if factor:
        extent = static_int(sch.get(inner).extent)
        if not extent or extent % factor:
            return False
        factor = 0 if extent == factor else factor  # (one block: the loop itself)
    if not factor and j == len(loops) - 1:
        return False
    if factor:
        _, inner = sch.split(inner, factors=[None, factor])
    sch.reorder(*[lp for lp in sch.get_loops(block) if not sch.get(lp).same_as(sch.get(inner))], inner)
    return True


def _selects(block) -> bool:
    """Whether a block picks each value from one of several expressions (a
    concatenation, a pad): vectorized, every branch is computed for every
    element, so a producer inlined into it would be computed for all of
    them. A GRU step's gates inlined into its concatenations were 2-3x
    slower."""
    return "if_then_else" in str(block.body)


def _touches_bool(block) -> bool:
    """Whether a block reads or writes a bool buffer. TVM 0.27's LLVM codegen
    computes wrong values from a bool intermediate when the blocks around
    it are vectorized: it holds the vector as <N x i8> and lowers `not` to
    `xor -1` (0/1 become -1/-2). RoBERTa's position ids (Equal, Not, Cast,
    CumSum) came out wrong: rel. L2 0.73 against ONNX Runtime. Such blocks
    stay scalar (mask arithmetic; the kernel's other blocks are vectorized);
    tests/passes/test_cpu_default.py::test_tvm_still_miscompiles_vectorized_bool_intermediates
    fails once TVM computes them right."""
    return any(str(r.source.dtype) == "bool" for r in (*block.reads, *block.writes))
