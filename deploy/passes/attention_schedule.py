"""The CUDA schedule of the fused attention kernel (passes/attention.py).

A thread block takes ROW_TILE (64) query rows of one (batch, head): four
groups of warps, sixteen rows each, of 1, 2 or 4 warps that split the
GEMMs' columns between them (attention.col_warps: 4, 8 or 16 warps a block,
the keys padded to 16, 32 or 64). In order, all in dynamic shared memory:

1. Q's 64 rows, and all of K's and V's keys (padded),
   are read from where the model's layout operators leave them (those are
   inlined into the copies: the QKV projection's output read in place),
   rows padded by 8 halves so that `ldmatrix` meets no bank conflict;
2. the scores S = Q K^T: an `mma.sync` GEMM (m16n8k16 through TVM's
   16x16x16 intrinsics, fp32 accumulators), each group its 16 rows against
   every key, stored to shared memory in fp32;
3. the softmax of each row, a warp a row (the rows' maximum and sum reduced
   across the warp's lanes by shuffles), the scale and bias applied as the
   scores are read, the probabilities written as fp16;
4. O = P V: the second `mma.sync` GEMM, its fp32 tile through shared memory
   to the output, cast and written in the output's layout (16-byte stores
   along the head dimension).

One shape per kernel, no decisions: the tuner leaves these kernels out
(tuning/tasks.py), and the build schedules them first, the rest of the
default chain behind it in case the schedule does not build
(passes/schedule.py).

Shared memory: Q, K and V tiles, fp32 scores and fp16 probabilities, and the
output tile: at most 174 KB for ViT's 197 keys in 8 warps (163 KB in 4), 110
KB for 128 (`shared_bytes`); the pass takes fewer warps where more would not
fit the architecture's opt-in limit, and rewrites only attention that fits.
"""

from __future__ import annotations

from .attention import ATTR, KEY_ALIGN, ROW_TILE, col_warps, is_attention, padded_keys

WARPS = 4  # a warp per 16 query rows
OUT_VECTOR = 8  # fp16 elements a thread writes at once
ROW_PAD = 8  # halves each fp16 shared row is padded by (conflict-free ldmatrix)
NAMES = ("attn_q", "attn_k", "attn_v", "attn_s", "attn_max", "attn_sum", "attn_p", "attn_o", "attn_out")


def shared_bytes(keys: int, head_dim: int, warps: int | None = None) -> int:
    """Shared memory the kernel asks for at most, static and dynamic, with
    `warps` to each 16 rows (by default col_warps()'s), its keys padded for
    them (a bound: TVM lets buffers whose lives do not overlap share, and
    ViT-S/16's kernel takes 87 KB of the 174 KB counted here)."""
    keys = padded_keys(keys, KEY_ALIGN * (col_warps(keys, head_dim) if warps is None else warps))
    fp16_rows = (ROW_TILE + 2 * keys) * (head_dim + ROW_PAD) + ROW_TILE * (keys + ROW_PAD)
    return 2 * fp16_rows + 4 * ROW_TILE * (keys + head_dim) + 8 * ROW_TILE


def _copy_vector(sch, block) -> int:
    """Elements a thread copies at once into a Q, K or V tile: 8 halves (16
    bytes) where every element it reads lies at 8 consecutive, 16-byte
    aligned addresses along the head dimension (`_contiguous`), 4 where
    the replayed layout operators compute in fp32 on the way (ViT's Q,
    scaled in fp32), 1 where the reads are not contiguous (a K^T the model
    made with the head dimension outermost). Workarounds of TVM 0.27's
    CUDA codegen, which prints a broadcast fp32 constant of 8 lanes, and a
    gather of 8 halves, as `make_ulonglong4` or `make_uint4` with 8
    arguments, which nvcc rejects ("too many arguments in function call");
    tests/passes/test_attention.py::test_tvm_prints_8_lane_fp32_broadcasts_nvcc_rejects
    fails once it does not."""
    b = sch.get(block)
    if _contiguous(b, 8) and "float32" not in b.script():
        return 8
    return 4 if _contiguous(b, 4) else 1


_BINARY = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
           "FloorDiv": lambda a, b: a // b, "FloorMod": lambda a, b: a % b, "Div": lambda a, b: int(a / b),
           "Mod": lambda a, b: a - b * int(a / b), "Min": min, "Max": max}


def _eval(expr, env: dict) -> int:
    """An integer index expression's value, its variables from `env`
    (raises on anything else: TVM 0.27 has no expression evaluator in
    Python)."""
    kind = type(expr).__name__
    if kind == "IntImm":
        return int(expr.value)
    if kind in ("Var", "SizeVar"):
        return env[expr.name]
    if kind == "Cast":
        return _eval(expr.value, env)
    return _BINARY[kind](_eval(expr.a, env), _eval(expr.b, env))


def _loads(expr) -> list:
    """The buffer loads in an expression."""
    found, todo = [], [expr]
    while todo:
        node = todo.pop()
        kind = type(node).__name__
        if kind in ("BufferLoad", "TensorLoad"):  # (TVM 0.27's name for a buffer's load)
            found.append(node)
            continue
        for attr in ("a", "b", "value", "condition", "true_value", "false_value"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (int, float)):
                todo.append(child)
        if kind == "Call":
            todo += list(node.args)
    return found


def _contiguous(block, vector: int) -> bool:
    """Whether every buffer the copy `block` reads is read at `vector`
    consecutive elements along its last iteration variable, starting at a
    multiple of `vector` (sampled at each other variable's ends)."""
    names = [iv.var.name for iv in block.iter_vars]
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    try:
        for load in _loads(block.body.value):
            shape = [int(d) for d in (load.source if hasattr(load, "source") else load.buffer).shape]
            strides = [1] * len(shape)
            for k in range(len(shape) - 2, -1, -1):
                strides[k] = strides[k + 1] * shape[k + 1]
            for corner in range(2 ** (len(names) - 1)):
                env = {n: (e - 1 if corner >> k & 1 else 0) for k, (n, e) in enumerate(zip(names[:-1], extents))}
                offsets = []
                for c in range(vector):
                    env[names[-1]] = c
                    offsets.append(sum(_eval(i, env) * st for i, st in zip(load.indices, strides)))
                if offsets[0] % vector or offsets != list(range(offsets[0], offsets[0] + vector)):
                    return False
    except (KeyError, AttributeError):  # (an index this cannot evaluate: not known to be contiguous)
        return False
    return True


def schedule(func, col_warps: int | None = None):
    """The scheduled kernel (a Schedule); raises where the kernel is not
    passes/attention.py's. `col_warps` > 1: that many warps share each 16
    rows, the GEMMs' columns split between them (WARPS x col_warps warps a
    block; the keys, padded, and the head dimension must split into 16-wide
    tiles evenly). By default the kernel's own (its ATTR's "col_warps",
    attention.col_warps(); 1 where it has none)."""
    from tvm.s_tir.tensor_intrin import cuda as ci

    from ..tvm_compat import register_tensor_intrinsics, s_tir, tvm

    if not is_attention(func):
        raise ValueError("not a fused attention kernel")
    if col_warps is None:
        col_warps = int(func.attrs[ATTR].get("col_warps", 1))
    warps = WARPS * col_warps
    register_tensor_intrinsics()
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    root = sch.get_sblock("root")
    for blk in sch.get_child_blocks(root):
        if sch.get(blk).name_hint not in NAMES:
            sch.compute_inline(blk)
    blk = {name: sch.get_sblock(name) for name in NAMES}

    # the product with V anchors the thread block: (batch, head, 64 rows)
    o = blk["attn_o"]
    n, m, i, c, r = sch.get_loops(o)
    io, ii = sch.split(i, [None, ROW_TILE])
    sch.reorder(n, m, io, ii, c, r)
    bx = sch.fuse(n, m, io)
    sch.bind(bx, "blockIdx.x")
    out = blk["attn_out"]
    sch.reverse_compute_at(out, bx)
    for name in ("attn_p", "attn_sum", "attn_max", "attn_s", "attn_q", "attn_k", "attn_v"):
        sch.compute_at(blk[name], bx)
    for name in ("attn_q", "attn_k", "attn_v", "attn_s", "attn_o"):
        sch.set_scope(blk[name], 0, "shared.dyn")
    # (the probabilities in a buffer of their own: in the one dynamic buffer
    # TVM could not tell their writes from the scores' reads, and put a
    # barrier in each step of the loop that writes them)
    for name in ("attn_max", "attn_sum", "attn_p"):
        sch.set_scope(blk[name], 0, "shared")

    def copy(b, vector):  # a tile's elements spread over the block's threads
        loops = sch.get_loops(b)[1:]
        steps, t1, t2, v = sch.split(sch.fuse(*loops), [None, warps, 32, vector])
        sch.bind(t1, "threadIdx.y")
        sch.bind(t2, "threadIdx.x")
        sch.vectorize(v)
        sch.unroll(steps)  # (a thread's loads all issued before its first store waits)

    for name in ("attn_q", "attn_k", "attn_v"):
        copy(blk[name], _copy_vector(sch, blk[name]))
        sch.storage_align(blk[name], 0, axis=-2, factor=32, offset=ROW_PAD)
    copy(out, OUT_VECTOR)

    def rows(b):  # each warp its 64 / warps rows, a row's keys across the lanes (a reduction: by shuffles)
        row, key = sch.get_loops(b)[1:]
        w, _ = sch.split(row, [warps, None])
        sch.bind(w, "threadIdx.y")
        _, lane = sch.split(key, [None, 32])
        sch.bind(lane, "threadIdx.x")

    for name in ("attn_max", "attn_sum", "attn_p"):  # (the probabilities: elementwise, laid out alike)
        rows(blk[name])
    sch.storage_align(blk["attn_p"], 0, axis=-2, factor=32, offset=ROW_PAD)

    _gemm(sch, blk["attn_s"], ci, a_intrin=ci.LDMATRIX_f16_A_DYN_INTRIN, transposed_b=True, col_warps=col_warps)
    _gemm(sch, blk["attn_o"], ci, a_intrin=ci.LDMATRIX_f16_A_INTRIN, transposed_b=False, col_warps=col_warps)
    return sch


def _gemm(sch, block, ci, a_intrin, transposed_b: bool, col_warps: int = 1):
    """One of the two GEMMs of a 64-row tile on tensor cores: each warp its
    16 rows and 1 / col_warps of the columns, the reduction in steps of 16;
    its fp32 result stored to the block's shared buffer."""
    from ..tvm_compat import tirx
    from .mma_gemm import fragment_loops, warp_accumulator

    name = sch.get(block).name_hint
    i, j, k = sch.get_loops(block)[-3:]
    i, i_tc = sch.split(i, [None, 16])
    j, j_tc = sch.split(j, [None, 16])
    k, k_tc = sch.split(k, [None, 16])
    if col_warps > 1:
        tiles = int(sch.get(j).extent)
        if tiles % col_warps:
            raise ValueError(f"{name}: {tiles} column tiles do not split between {col_warps} warps")
        jw, j = sch.split(j, [col_warps, None])
        sch.reorder(i, jw, k, j, i_tc, j_tc, k_tc)
        i = sch.fuse(i, jw)  # (a warp: its 16 rows and its share of the columns)
    else:
        sch.reorder(i, k, j, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    sch.bind(i, "threadIdx.y")
    a_w = sch.cache_read(outer, 0, "warp")
    b_w = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_w, k)
    sch.compute_at(b_w, j)  # (a fragment of B at a time, just before its mma)
    c_w = warp_accumulator(sch, outer, i)
    init_outer = sch.decompose_reduction(outer, k)
    inner, init = sch.get_sblock(name), sch.get_sblock(name + "_init")
    # every loop over a warp's fragments unrolled: a fragment's registers
    # are then known at compile time (a loop left to nvcc put them in
    # local memory: 4 KB of stack)
    sch.unroll(sch.get_loops(init_outer)[-1])
    sch.unroll(j)
    sch.unroll(sch.get_loops(c_w)[-4])
    sch.unroll(sch.get_loops(c_w)[-3])

    def fragment(b):
        fragments, tensorized = fragment_loops(sch, b)
        for loop in fragments:
            sch.unroll(loop)
        return tensorized

    la, lb = fragment(a_w), fragment(b_w)

    def tiles(b, kind):  # a warp buffer's [..., r, c] -> [..., its 16x16 tile, (thread, register) within it]
        shape = (sch.get(b).writes if kind == "write" else sch.get(b).reads)[0].source.shape
        rank, index_dtype = len(shape), str(shape[0].ty.dtype)

        def to(*idx):
            r, c = idx[-2:]
            return [*idx[:-2], r // 16, c // 16, *ci.shared_16x16_to_ldmatrix_32x8_layout(r % 16, c % 16)]

        sch.transform_layout(b, (kind, 0), tirx.IndexMap.from_func(to, ndim=rank, index_dtype=index_dtype))

    tiles(a_w, "write")
    tiles(b_w, "write")
    tiles(c_w, "read")
    sch.tensorize(la, a_intrin)
    if transposed_b:
        sch.tensorize(lb, ci.LDMATRIX_f16_B_TRANS_DYN_INTRIN)
        sch.tensorize(sch.get_loops(inner)[-3], ci.MMA_f16f16f32_TRANS_B_INTRIN)
    else:
        sch.tensorize(lb, ci.LDMATRIX_f16_B_DYN_INTRIN)
        sch.tensorize(sch.get_loops(inner)[-3], ci.MMA_f16f16f32_INTRIN)
    sch.tensorize(sch.get_loops(init)[-2], ci.MMA_fill_16x16_f32_INTRIN)
    sch.tensorize(sch.get_loops(c_w)[-2], ci.MMA_store_16x16_f32_shared_dyn_INTRIN)


class Default:
    """This schedule as a rule of the build (passes/schedule.py): the fused
    attention kernels, on CUDA with sm_80's `mma.sync`."""

    def apply(self, func, target, tunable=False):
        from .mma_gemm import available

        if not is_attention(func) or not available(target):
            return None
        return schedule(func)
