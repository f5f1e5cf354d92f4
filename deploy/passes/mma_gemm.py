"""Our `mma.sync` tensor-core GEMM, as design spaces the tuner chooses among.

MetaSchedule's tensor-core tiling gives the large GEMMs of a transformer or
a flattened CNN WMMA kernels without `cp.async` or a software pipeline, at
8 to 11% of the H200's fp16 peak (ViT-S/16 at batch 32, ConvNeXt-T), and
TVM 0.27's own `mma.sync` rule built no valid candidate of most of them
(docs/tvm-notes.md). This schedule, written by hand from TVM's own
intrinsics (scripts/mma_gemm_probe.py measured it: 333 TFLOP/s on a 4096^3
GEMM, and 55.5 against 82.2 us for ViT's fc1 under today's tuned WMMA):

- the block computes a `bm x bn` tile of C with `wm x wn` warps, each warp
  `bm/wm x bn/wn` of it as 16x16 fragments, m16n8k16 `mma.sync` through
  TVM's 16x16x16 intrinsics, fp32 accumulators in registers;
- A and B tiles of `bk` columns staged in dynamic shared memory by 16-byte
  copies (rows padded by 8 halves: no bank conflicts for `ldmatrix`), in a
  `stages`-deep `cp.async` software pipeline;
- `ldmatrix` into registers, itself pipelined one fragment ahead;
- where the kernel has an epilogue (cast, bias, GELU, residual), the
  accumulators go through a shared-memory tile, and the epilogue is applied
  as the block writes C to global memory (four elements a thread at a time);
  without one, they are stored to global memory from registers.

Each configuration (`CONFIGS`) is one design space without decisions, so
the search measures each once (`tuning/search.py` measures them first);
those whose tiles do not divide the GEMM, or whose pipeline would have
fewer than `stages - 1` K tiles, are left out (`configs_for`). A two-stage
pipeline is not offered: it computed wrong results on every shape on the
H200 (results/h200/2026-12-04/mma-gemm-probe/).

It applies to a kernel with one reduction block computing
`C[i, j] += f32(A[i, k]) * f32(B[k, j])` (or `B[j, k]`) over fp16 A, B and
an fp32 C, whose inputs are function parameters or each written by one
injective block reading parameters (pad_gemm's row padding, staged in
shared memory as it is computed: the rows past the end are zero-filled),
and injective 2-D blocks after it, each reading the GEMM's result (or
what the blocks before it made of it) element-wise, at its own [i, j], the
last writing the kernel's output.
A GEMM whose rows no configuration tiles has them padded to a multiple of
64 inside the schedule (`plan`: ViT's 197 tokens and ConvNeXt-T's 196
pixels at batch 1), and where its columns or K are not tiled either, those
to multiples of 64 and 32 (EfficientNet-B0's 40 to 112 channels).
Batched matmuls (attention) are left to MetaSchedule's rules; 1x1 convolutions and
`[batch, seq, K]` matmuls take this schedule once `--flat-gemm` makes them
2-D.

(Over 500 lines: the schedule, the GEMMs it matches and plans, and the
configurations it is given are one rule's; each reads the others'
details: a configuration's shared memory, a padded GEMM's blocks.)

Its tiles use more than the 48 KB of shared memory a block gets by
default: the kernel's dynamic shared memory is raised at launch (TVM's
CUDA runtime does so above 48 KB), and `verify_postproc` judges these
kernels against the architecture's opt-in limit (`OPT_IN_SHARED_MEMORY`).
"""

from __future__ import annotations

MARKER = "deploy.mma_gemm"  # block annotation: which configuration made the kernel

# name: (block rows, block cols, warps along rows, warps along cols, K tile, pipeline stages)
CONFIGS = {
    "128x128x32-w2x2-s3": (128, 128, 2, 2, 32, 3),
    "128x128x32-w2x2-s4": (128, 128, 2, 2, 32, 4),
    "128x128x64-w2x2-s3": (128, 128, 2, 2, 64, 3),
    "64x128x32-w2x2-s4": (64, 128, 2, 2, 32, 4),
    "128x64x32-w2x2-s4": (128, 64, 2, 2, 32, 4),
    "128x256x32-w2x4-s3": (128, 256, 2, 4, 32, 3),
    "256x128x32-w4x2-s3": (256, 128, 4, 2, 32, 3),
    "64x64x32-w2x2-s4": (64, 64, 2, 2, 32, 4),
    # N = 96 (ConvNeXt-T's stage 1: 44.2 us where cuBLAS takes 33.5), and the
    # fastest at ViT's fc2, 6400x384x1536 (32.1 against 37.4 us)
    "128x96x32-w4x1-s4": (128, 96, 4, 1, 32, 4),
}
EPILOGUE_VECTOR = 4  # elements a thread writes at once in the epilogue

# The untuned default of a GEMM this schedule takes (`Default`, in the CUDA
# chain of passes/schedule.py just before DLight's Matmul): the first of these
# that tiles it with at least GRID_BLOCKS thread blocks, else the one that
# gives it the most. DLight's tensor-core Matmul gave ResNet-50 b64's first
# implicit GEMM 597 us a call where these tiles take 89.6, and ConvNeXt-T b1's
# 196-row fc2 two 128x128 tiles' rows (6 blocks on 132 SMs): 82-95 us a call,
# 12.9 with 64x64 tiles (results/h200/2026-12-04/resnet50-b64-implicit-gemm/,
# small-row-gemm-probe/).
# Last, 128x96: for N = 96 (ConvNeXt-T's stage 1), which no other tile divides.
DEFAULT_CONFIGS = ("128x128x32-w2x2-s4", "128x64x32-w2x2-s4", "64x128x32-w2x2-s4", "64x64x32-w2x2-s4",
                   "128x96x32-w4x1-s4")
GRID_BLOCKS = 128  # about a block per SM: an H200 has 132, an A100 108
# A GEMM whose rows no tile divides (ViT's 197 tokens, ConvNeXt-T b1's 196
# and 49 pixels) has its rows padded to a multiple of ROW_TILE inside the
# schedule (`plan`; pad_gemm pads only from 1,024 rows, in the graph); fewer
# than SMALL_ROWS rows are a GEMV's, left to DLight.
ROW_TILE = 64
SMALL_ROWS = 32
# Where no tile divides its columns or K either (EfficientNet-B0's 1x1 convolutions at batch 1: 196 or 784
# rows, 40, 80 or 112 channels), those are padded too, to multiples of COL_TILE and K_TILE: its padded
# columns and K read zeros, and are never written out. On the H100 DLight's Matmul ran them at 0.5-1.7
# TFLOP/s, 20-45 us a call (results/h100/2026-12-06/verify-conv-transpose-vector-rows/profile-efficientnet_b0-b1/).
COL_TILE = 64
K_TILE = 32
SMALL_COLS = 32  # (fewer columns, a classifier's 10, are not padded: most of the tile would be padding)

# Dynamic shared memory a block may opt in to, by architecture (CUDA
# programming guide, "Technical Specifications per Compute Capability").
OPT_IN_SHARED_MEMORY = {"sm_70": 98304, "sm_72": 98304, "sm_75": 65536, "sm_80": 166912, "sm_86": 101376,
                        "sm_87": 166912, "sm_89": 101376, "sm_90": 232448, "sm_90a": 232448, "sm_100": 232448,
                        "sm_100a": 232448, "sm_120": 101376}


class Gemm:
    """What `match` found: the reduction block's name, M, N, K, whether B is
    stored [N, K], the names of the blocks around it, and the inputs' dtype
    (float16, or float32 computed in TF32: passes/tf32.py)."""

    def __init__(self, name, m, n, k, b_transposed, producers, epilogue, dtype="float16"):
        self.name, self.m, self.n, self.k = name, m, n, k
        self.b_transposed, self.producers, self.epilogue, self.dtype = b_transposed, producers, epilogue, dtype


def match(func, tf32: bool = False, multiple: int = 16) -> Gemm | None:
    """The GEMM this schedule takes in `func` (a PrimFunc), else None. An
    fp32 GEMM only where TF32 is allowed: `func` has passes/tf32.py's
    attribute, or `tf32` is set (what tf32.mark asks). M, N and K each a
    multiple of `multiple` (this schedule's 16; the wgmma kernel asks 8)."""
    from ..tvm_compat import s_tir, tirx, tvm
    from .kernel_shape import point_indices, static_int
    from .tf32 import allowed

    if not isinstance(func, tirx.PrimFunc):
        return None
    tf32 = tf32 or allowed(func)
    try:
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0)
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - no root block: not a kernel of ours
        return None
    reductions = [i for i, b in enumerate(blocks) if any(int(v.iter_type) == 2 for v in b.iter_vars)]
    if len(reductions) != 1:
        return None
    at = reductions[0]
    main = blocks[at]
    kinds = [int(v.iter_type) for v in main.iter_vars]
    if kinds != [0, 0, 2] or len(main.reads) != 2 or len(main.writes) != 1:
        return None
    vi, vj, vk = (v.var for v in main.iter_vars)
    extents = [static_int(v.dom.extent) for v in main.iter_vars]
    if None in extents or any(e % multiple for e in extents):
        return None
    c = main.writes[0]
    if str(c.source.dtype) != "float32" or [str(x) for x in point_indices(c)] != [str(vi), str(vj)]:
        return None
    a, b = main.reads
    dtype = str(a.source.dtype)
    if str(b.source.dtype) != dtype or dtype not in (("float16", "float32") if tf32 else ("float16",)):
        return None
    if [str(x) for x in point_indices(a)] != [str(vi), str(vk)]:
        return None
    b_idx = [str(x) for x in point_indices(b)]
    if b_idx == [str(vk), str(vj)]:
        b_transposed = False
    elif b_idx == [str(vj), str(vk)]:
        b_transposed = True
    else:
        return None
    if not is_multiply_accumulate(main.body, c.source):
        return None
    # before the GEMM: only the producers of A and B, each injective
    producers = []
    for blk in blocks[:at]:
        if any(int(v.iter_type) != 0 for v in blk.iter_vars) or len(blk.writes) != 1:
            return None
        written = blk.writes[0].source
        if not (written.same_as(a.source) or written.same_as(b.source)):
            return None
        producers.append(blk.name_hint)
    # after it: injective blocks only, each reading the GEMM's result (and
    # what the blocks before it made of that) at its own [i, j]: element-wise,
    # so that a thread block's epilogue reads its own tile only
    epilogue = []
    derived = [c.source]
    for blk in blocks[at + 1:]:
        if any(int(v.iter_type) != 0 for v in blk.iter_vars) or len(blk.writes) != 1 or len(blk.iter_vars) != 2:
            return None
        own = [str(v.var) for v in blk.iter_vars]
        for r in [*blk.reads, *blk.writes]:
            if any(r.source.same_as(d) for d in derived) and [str(x) for x in point_indices(r)] != own:
                return None
        if [str(x) for x in _unit_lead(point_indices(blk.writes[0]), blk.writes[0].source)] != own:
            return None
        derived.append(blk.writes[0].source)
        epilogue.append(blk.name_hint)
    if any(any(p.same_as(d) for p in func.params) for d in derived[1:-1]):
        return None  # (an output before the last block: the schedule computes the epilogue into the last one)
    return Gemm(main.name_hint, extents[0], extents[1], extents[2], b_transposed, producers, epilogue, dtype)


def _unit_lead(indices: list, buf) -> list:
    """`indices` without the leading zeros on `buf`'s axes of extent 1, down
    to two: an output of [1, M, N] written at [0, i, j] (passes/unit_batch.py)."""
    from .kernel_shape import static_int

    n = 0
    while len(indices) - n > 2 and static_int(indices[n]) == 0 and static_int(buf.shape[n]) == 1:
        n += 1
    return indices[n:]


def is_multiply_accumulate(body, c_buf) -> bool:
    """`C[...] = C[...] + cast(A[...]) * cast(B[...])`, the casts optional
    (fp32 inputs: `match` checks the dtypes) (node types by name:
    TVM 0.27's `tirx.BufferLoad` is a function, and the node a `TensorLoad`
    whose buffer is `.source`)."""

    def kind(x, name):
        return type(x).__name__ in ({"BufferLoad", "TensorLoad"} if name == "BufferLoad" else {name})

    if not kind(body, "BufferStore") or not body.buffer.same_as(c_buf):
        return False
    v = body.value
    if not kind(v, "Add"):
        return False
    acc, prod = (v.a, v.b) if kind(v.a, "BufferLoad") else (v.b, v.a)
    if not (kind(acc, "BufferLoad") and acc.source.same_as(c_buf) and kind(prod, "Mul")):
        return False
    return all(kind(x.value if kind(x, "Cast") else x, "BufferLoad") for x in (prod.a, prod.b))


def _tiles(gemm: Gemm, config: tuple) -> bool:
    """Whether a configuration's tiles divide this GEMM and its pipeline has
    at least stages - 1 K tiles (see configs_for)."""
    bm, bn, _, _, bk, stages, *_ = config
    return gemm.m % bm == 0 and gemm.n % bn == 0 and gemm.k % bk == 0 and gemm.k // bk >= stages - 1


def configs_for(gemm: Gemm) -> list[str]:
    """The configurations whose tiles divide this GEMM and whose pipeline
    has at least stages - 1 K tiles (with fewer, the `cp.async` waits do
    not lower: `cp_async_wait_group: immediate operands must become
    compile-time constants`; with stages - 1, ConvNeXt's K = 96 GEMM took
    a 4-stage configuration that the kernel check passed on the H200)."""
    return [name for name, config in CONFIGS.items() if _tiles(gemm, config)]


def plan(func, tf32: bool = False) -> tuple[Gemm, list | None] | None:
    """(the GEMM this schedule takes in `func`, pad_einsum's padding of its
    loops or None), or None where no configuration tiles it: `match`'s GEMM
    as it is where one does, else with its rows padded to a multiple of
    ROW_TILE (from SMALL_ROWS rows; the padded rows read zeros and are
    never written out, as pad_gemm's), else with its columns (from
    SMALL_COLS) and K padded too, to multiples of COL_TILE and K_TILE."""
    from ..tvm_compat import s_tir, tvm
    from .pad_gemm import pad_rows_in, row_padding, tile_padding

    gemm = match(func, tf32)
    if gemm is not None and (configs_for(gemm) or default_config(gemm)):
        return gemm, None
    for pad in (lambda: row_padding(func, ROW_TILE, SMALL_ROWS),
                lambda: tile_padding(func, {"m": ROW_TILE, "n": COL_TILE, "k": K_TILE}, SMALL_ROWS, SMALL_COLS)):
        padding = pad()
        if padding is None:
            continue
        try:
            sch = s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0)
            pad_rows_in(sch, padding)
            padded = match(sch.mod["main"], tf32)
        except Exception:  # noqa: BLE001 - pad_einsum declined
            padded = None
        if padded is not None and (configs_for(padded) or default_config(padded)):
            return padded, padding
    return None


def spaces(func, target) -> list:
    """One Schedule per configuration that divides the GEMM (none where
    `plan` finds none or the target is not `available`)."""
    if not available(target):
        return []
    planned = plan(func)
    if planned is None:
        return []
    gemm, padding = planned
    out = []
    for name in configs_for(gemm):
        try:
            out.append(schedule(func, gemm, name, padding))
        except Exception:  # noqa: BLE001, S112 - a ScheduleError: this configuration does not apply here
            continue
    return out


def default_config(gemm: Gemm, target=None) -> str | None:
    """The configuration `Default` gives this GEMM (see DEFAULT_CONFIGS), or
    None where none of them tiles it (within the target architecture's
    shared memory, where it is known: fp32 tiles take twice an fp16's). A
    K of two tiles (64) takes each tile in a 3-stage pipeline instead
    (ResNet-50's 1x1 convolutions over 64 channels, as GEMMs)."""
    limit = OPT_IN_SHARED_MEMORY.get(_arch(target)) if target is not None else None
    blocks = {}  # the fitting candidates, in order: name -> thread blocks
    for name in DEFAULT_CONFIGS:
        config = CONFIGS[name]
        if gemm.k // config[4] == 2:
            config = (*config[:5], 3)
            name = name_of(config)
        if _tiles(gemm, config) and (limit is None or shared_bytes(gemm, config) <= limit):
            blocks[name] = (gemm.m // config[0]) * (gemm.n // config[1])
    if not blocks:
        return None
    return next((c for c, n in blocks.items() if n >= GRID_BLOCKS), max(blocks, key=blocks.get))


def plan_any(func, tf32: bool = False) -> tuple[Gemm, list | None, object] | None:
    """(the GEMM, its padding, the function to schedule): `plan` of
    `func`, else of its GEMM over [1, M, K] rows made 2-D
    (passes/unit_batch.py: the same parameters, its blocks rewritten); None
    where neither applies. For the untuned default and TF32's marking, not
    for tuning's spaces (a trace must replay from the workload itself)."""
    from .unit_batch import as_2d

    planned = plan(func, tf32)
    if planned is not None:
        return (*planned, func)
    flat = as_2d(func)
    planned = plan(flat, tf32) if flat is not None else None
    return None if planned is None else (*planned, flat)


class Default:
    """This schedule as a default rule of the build's chain (passes/schedule.py:
    `apply(func, target, tunable)` returns a schedule, or None where it does
    not apply): the GEMMs `match` takes, on a target that is `available`, in
    `default_config`'s configuration."""

    def apply(self, func, target, tunable=False):
        if not available(target):
            return None
        planned = plan_any(func)  # (a GEMM over [1, M, K] rows too, its blocks made 2-D)
        if planned is None:
            return None
        gemm, padding, func = planned
        config = default_config(gemm, target)
        return None if config is None else schedule(func, gemm, config, padding)


def _arch(target) -> str:
    return str(target.attrs.get("arch", "")) if target.attrs else ""


def available(target) -> bool:
    """Whether the target is CUDA with sm_80's `cp.async`."""
    if target.kind.name != "cuda":
        return False
    try:
        return int("".join(ch for ch in _arch(target).split("_")[-1] if ch.isdigit())) >= 80
    except ValueError:
        return False


def schedule(func, gemm: Gemm, config: str | tuple, padding: list | None = None):
    """The schedule of `func` under one configuration, a name in CONFIGS or
    its tuple (scripts/mma_gemm_probe.py tries others), its loops first
    padded by `padding` where `plan` gives one (`gemm` is then the padded
    GEMM); raises a ScheduleError where it does not apply. A tuple may go on with the
    blocks per SM to compile for (`__launch_bounds__`' second argument, 0
    for none) and whether the `ldmatrix` fragments are double-buffered (1,
    the default, or 0)."""
    from tvm.s_tir.tensor_intrin import cuda as ci

    from ..tvm_compat import register_tensor_intrinsics, s_tir, tvm
    from . import tf32
    from .tensor_core_smem import MIN_BLOCKS

    register_tensor_intrinsics()
    fp32 = gemm.dtype == "float32"
    bm, bn, wm, wn, bk, stages, *knobs = config_from_name(config) if isinstance(config, str) else config
    min_blocks, fragment_pipeline = _knobs(knobs)
    if not isinstance(config, str):
        config = name_of((bm, bn, wm, wn, bk, stages, min_blocks, fragment_pipeline))
    fm, fn = bm // 16 // wm, bn // 16 // wn  # 16x16 fragments per warp along rows, cols
    warps = wm * wn
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    if padding is not None:
        from .pad_gemm import pad_rows_in

        pad_rows_in(sch, padding)
    main = sch.get_sblock(gemm.name)
    for name in gemm.epilogue[:-1]:  # the epilogue computed as the output is written
        sch.compute_inline(sch.get_sblock(name))
    out = sch.get_sblock(gemm.epilogue[-1]) if gemm.epilogue else None

    i, j, kk = sch.get_loops(main)
    i, i_tc = sch.split(i, [None, 16])
    j, j_tc = sch.split(j, [None, 16])
    kk, k_tc = sch.split(kk, [None, 16])
    sch.reorder(i, j, kk, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    sch.annotate(outer, MARKER, config)
    if min_blocks:
        sch.annotate(outer, MIN_BLOCKS, min_blocks)
    i0, i2, i3 = sch.split(i, [None, wm, fm])
    j0, j2, j3 = sch.split(j, [None, wn, fn])
    k0, k1 = sch.split(kk, [None, bk // 16])
    sch.reorder(i0, j0, i2, j2, k0, k1, i3, j3)
    bx = sch.fuse(i0, j0)
    sch.bind(bx, "blockIdx.x")
    ty = sch.fuse(i2, j2)
    sch.bind(ty, "threadIdx.y")

    def to_shared(index: int):
        vector, offset = _shared_copy(gemm, index)
        buf = sch.get(outer).reads[index].source
        writer = [p for p in sch.get_producers(outer) if sch.get(p).writes[0].source.same_as(buf)]
        if writer:  # (the padding, computed into shared memory)
            stage = writer[0]
            sch.set_scope(stage, 0, "shared.dyn")
        else:
            stage = sch.cache_read(outer, index, "shared.dyn")
        sch.compute_at(stage, k0)
        fused = sch.fuse(*sch.get_loops(stage)[-2:])
        _, f1, f2, f3 = sch.split(fused, [None, warps, 32, vector])
        sch.bind(f2, "threadIdx.x")
        sch.bind(f1, "threadIdx.y")
        sch.vectorize(f3)
        sch.storage_align(stage, 0, axis=-2, factor=32, offset=offset)

    to_shared(0)
    to_shared(1)
    a_w = sch.cache_read(outer, 0, "warp")
    b_w = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_w, k1)
    sch.compute_at(b_w, k1)
    c_w = warp_accumulator(sch, outer, ty)
    if out is not None:  # the accumulators through a shared tile, the epilogue as C is written
        sch.set_scope(c_w, 0, "shared.dyn")
        sch.reverse_compute_at(out, bx)
        rows, cols = sch.get_loops(out)[1:]
        # each thread's elements within one row, so that they stay contiguous
        # (fused over the whole tile, a row of 96 left TVM unable to vectorize)
        cols, vec = sch.split(cols, [None, EPILOGUE_VECTOR])
        _, t1, t2 = sch.split(sch.fuse(rows, cols), [None, warps, 32])
        sch.bind(t2, "threadIdx.x")
        sch.bind(t1, "threadIdx.y")
        sch.vectorize(vec)
        store = ci.MMA_store_16x16_f32_shared_dyn_INTRIN
    else:
        store = ci.MMA_store_16x16_f32_global_INTRIN
    sch.decompose_reduction(outer, sch.get_loops(outer)[2])
    init = sch.get_sblock(gemm.name + "_init")

    la, lb = fragment_loops(sch, a_w)[1], fragment_loops(sch, b_w)[1]

    def tiles(layout):  # a warp buffer's [r, c] -> its 16x16 tile, then (thread, register) within it
        return lambda r, c: (r // 16, c // 16, *layout(r % 16, c % 16))

    index_map = tiles(ci.shared_16x16_to_ldmatrix_32x8_layout)
    if fp32:  # (passes/tf32.py: the m16n8k8 fragments' layouts, keyed on [i, k] and [k, n])
        a_map = tiles(tf32.a_layout)
        b_map = tiles((lambda n, k: tf32.b_layout(k, n)) if gemm.b_transposed else tf32.b_layout)
    else:
        a_map = b_map = index_map
    sch.transform_layout(a_w, ("write", 0), a_map)
    sch.transform_layout(b_w, ("write", 0), b_map)
    sch.transform_layout(c_w, ("read", 0), index_map)
    if fp32:
        sch.tensorize(la, tf32.A_LDMATRIX)
        sch.tensorize(lb, tf32.B_NK_LDMATRIX if gemm.b_transposed else tf32.B_KN_LOAD)
        sch.tensorize(sch.get_loops(main)[-3], tf32.MMA)
    elif gemm.b_transposed:
        sch.tensorize(la, ci.LDMATRIX_f16_A_DYN_INTRIN)
        sch.tensorize(lb, ci.LDMATRIX_f16_B_TRANS_DYN_INTRIN)
        sch.tensorize(sch.get_loops(main)[-3], ci.MMA_f16f16f32_TRANS_B_INTRIN)
    else:
        sch.tensorize(la, ci.LDMATRIX_f16_A_DYN_INTRIN)
        sch.tensorize(lb, ci.LDMATRIX_f16_B_DYN_INTRIN)
        sch.tensorize(sch.get_loops(main)[-3], ci.MMA_f16f16f32_INTRIN)
    sch.tensorize(sch.get_loops(init)[-2], ci.MMA_fill_16x16_f32_INTRIN)
    sch.tensorize(sch.get_loops(c_w)[-2], store)
    # k0's body once k1 is pipelined: the two shared copies, then k1's
    # prologue (the first fragments' ldmatrix), body and epilogue; the next
    # tile's prologue is issued before this tile's epilogue
    # (without it, k0's body is the two shared copies, then k1)
    stage, order = (([0, 0, stages - 2, stages - 1, stages - 1], [0, 1, 3, 2, 4]) if fragment_pipeline
                    else ([0, 0, stages - 1], [0, 1, 2]))
    sch.annotate(k0, "software_pipeline_stage", stage)
    sch.annotate(k0, "software_pipeline_order", order)
    sch.annotate(k0, "software_pipeline_async_stages", [0])
    if fragment_pipeline:
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    return sch


def warp_accumulator(sch, block, at):
    """The `warp` accumulator of a blockized 16x16x16 GEMM `block`, written
    back under loop `at` by 16x16 tiles (the loops the store intrinsic
    tensorizes); also the fused attention kernel's two GEMMs'."""
    c_w = sch.cache_write(block, 0, "warp")
    sch.reverse_compute_at(c_w, at)
    ii, jj = sch.get_loops(c_w)[-2:]
    io, ii = sch.split(ii, [None, 16])
    jo, ji = sch.split(jj, [None, 16])
    sch.reorder(io, jo, ii, ji)
    return c_w


def fragment_loops(sch, block) -> tuple:
    """A `warp` operand's copy `block` by 16x16 fragments: (the loops over
    the fragments, the loop ldmatrix tensorizes)."""
    a, b = sch.get_loops(block)[-2:]
    a0, a1 = sch.split(a, [None, 16])
    b0, b1 = sch.split(b, [None, 16])
    sch.reorder(a0, b0, a1, b1)
    return (a0, b0), a1


def _shared_copy(gemm: Gemm, index: int) -> tuple[int, int]:
    """For input `index` (0: A, 1: B) of this GEMM: the elements of one
    16-byte `cp.async`, and the row padding of its shared tile (elements,
    stride mod 32): fp16 rows padded by 8 halves, fp32 by passes/tf32.py's
    SHARED_ROW_OFFSET."""
    if gemm.dtype == "float16":
        return 8, 8
    from .tf32 import SHARED_ROW_OFFSET, VECTOR

    by_ldmatrix = index == 0 or gemm.b_transposed
    return VECTOR, SHARED_ROW_OFFSET["ldmatrix" if by_ldmatrix else "load"]


def shared_bytes(gemm: Gemm, config) -> int:
    """Dynamic shared memory this configuration's kernel asks for, at most:
    `stages` A and B tiles with padded rows, and the fp32 accumulator tile
    of an epilogue (TVM may let it reuse the pipeline's)."""
    bm, bn, _, _, bk, stages, *_ = config_from_name(config) if isinstance(config, str) else config
    size = 2 if gemm.dtype == "float16" else 4

    def padded(cols, index):
        return cols + (_shared_copy(gemm, index)[1] - cols) % 32

    b_tile = bn * padded(bk, 1) if gemm.b_transposed else bk * padded(bn, 1)
    return stages * (bm * padded(bk, 0) + b_tile) * size + (bm * bn * 4 if gemm.epilogue else 0)


def _knobs(knobs) -> tuple:
    """A configuration's optional entries, defaults filled in: (blocks per
    SM, fragments double-buffered)."""
    return tuple(knobs) + (0, 1)[len(knobs):]


def config_from_name(name: str) -> tuple:
    """The configuration tuple of a name in `name_of`'s form (a name in
    CONFIGS among them); raises ValueError for any other string."""
    if name in CONFIGS:
        return CONFIGS[name]
    try:
        head, rest = name.split("-w", 1)
        bm, bn, bk = (int(x) for x in head.split("x"))
        warps, stage, *extra = rest.split("-")
        wm, wn = (int(x) for x in warps.split("x"))
        knobs = {e[0]: int(e[1:]) for e in extra}
        config = (bm, bn, wm, wn, bk, int(stage[1:]), knobs.get("b", 0), knobs.get("f", 1))
        # (the name written back must be this one: that refuses unknown, repeated or default-valued
        # knobs, b0, f1, f2 and a stage count without its "s")
        ok = (config[5] >= 2 and min(bm, bn, wm, wn, bk) > 0 and bm % (16 * wm) == 0 and bn % (16 * wn) == 0
              and bk % 16 == 0 and name_of(config) == name)
    except (ValueError, IndexError):
        ok = False
    if not ok:
        raise ValueError(f"not a configuration name: {name!r} (e.g. 128x128x32-w2x2-s4, 128x128x32-w2x2-s3-b3-f0)")
    return config


def name_of(config: tuple) -> str:
    """A configuration tuple's name: `CONFIGS`' form, with `-b<blocks per
    SM>` and `-f0` (fragments not double-buffered) where they are set."""
    bm, bn, wm, wn, bk, stages, *knobs = config
    min_blocks, fragment_pipeline = _knobs(knobs)
    return (f"{bm}x{bn}x{bk}-w{wm}x{wn}-s{stages}" + (f"-b{min_blocks}" if min_blocks else "")
            + ("" if fragment_pipeline else "-f0"))


def config_of(mod) -> str | None:
    """The configuration of this schedule a scheduled module's kernel has, or None."""
    from .mma_epilogue import _blocks

    for f in mod.functions.values():
        for b in _blocks(f.body) if hasattr(f, "body") else []:
            if MARKER in b.annotations:
                return str(b.annotations[MARKER])
    return None


def is_ours(mod) -> bool:
    """Whether a scheduled module holds a kernel of this schedule."""
    return config_of(mod) is not None


def verify_postproc(target):
    """MetaSchedule's VerifyGPUCode, with the architecture's opt-in shared
    memory limit for tensor-core kernels (this schedule's and MetaSchedule's
    own: their shared memory is dynamic; TVM's runtime raises the limit at
    launch), lowered as our TIR pipeline lowers them, and the target's own
    for every other kernel. (mma_epilogue.postprocs runs it after
    RewriteTensorize: it says why.)"""
    from ..tvm_compat import derived_object, ms, tvm
    from . import tensor_core_smem

    limit = OPT_IN_SHARED_MEMORY.get(_arch(target))
    if limit is None:
        return ms.postproc.VerifyGPUCode()
    config = dict(target.export())
    config["max_shared_memory_per_block"] = limit
    config.pop("tag", None)
    relaxed_target = tvm.target.Target(config)

    @derived_object
    class VerifyGPUCodeOptIn(ms.postproc.PyPostproc):
        def __init__(self):
            self.stock = ms.postproc.VerifyGPUCode()
            self.relaxed = ms.postproc.VerifyGPUCode()

        def _initialize_with_tune_context(self, context):
            self.stock._initialize_with_tune_context(context)
            self.relaxed._initialize_with_tune_context(ms.TuneContext(target=relaxed_target))

        def apply(self, sch) -> bool:
            if not (is_ours(sch.mod) or tensor_core_smem.has_fragments(sch.mod)):
                return self.stock.apply(sch)
            # lowered as our TIR pipeline lowers a tensor-core kernel
            # (tensor_core_smem.py: StorageRewrite mistypes its accumulator otherwise)
            with tensor_core_smem.tensor_core_context():
                return self.relaxed.apply(sch)

        def clone(self):
            return VerifyGPUCodeOptIn()

    return VerifyGPUCodeOptIn()
