"""How the wgmma kernel (passes/wgmma_gemm.py) applies a GEMM's epilogue
and stores the result: the consumers' part of the kernel after the
products, as TVMScript text over the template's names.

`wgmma` leaves a thread two adjacent columns of a row in each 8-column
block, the rows 8 apart: stored as they lie (`registers`, the first
epilogue), a warp's store writes 16 bytes of each of 8 rows (a 32-byte
sector half used), and its 2-byte loads of a residual a quarter. Nsight
Compute on ResNet-50's first 1x1 convolution as a GEMM at batch 64 (an
H100, results/h100/2026-12-06/depthwise-b32/): 64% of its sectors
excessive, 1.5 TB/s, its warps stalled 73% of their cycles on those loads.
So by default (`staged`), as CUTLASS's epilogues do, each warp writes its
accumulators (fp32) a chunk of columns at a time to shared memory of its
own, reads back 8 adjacent columns of a row a thread, applies the epilogue
there, and stores them in 16 bytes; a warp's store writes whole rows of
the chunk (64 bytes each). The epilogue's loads of a [rows, N] parameter
(a residual) or of an [N] one (a bias) at the thread's row and column
become 16-byte loads into registers, the rows' issued before the tile's
products begin where they fit in `PREFETCH_BYTES` a thread (the loads'
latency under the products and the TMA waits: a warp otherwise waits on
them once a chunk), else at the chunk's start. On that GEMM with its bias, residual and ReLU, 126 ->
87 us (2.65 TB/s), and ResNet-50 b64 3.296 -> 2.843 ms, ViT-S/16 b32
1.260 -> 1.134 (an H100, untuned: results/h100/2026-12-06/epilogue-staged/).

Shared memory a warp: 16 rows of a chunk of `CHUNK_BLOCKS` 8-column blocks,
rows `stride` floats apart (32 + 8: the writes, 4 rows of 8 columns each
half-warp, fall in distinct banks; the reads of two rows a quarter-warp
conflict two ways, which a swizzle would avoid: not measured). Where the
tile's 8-column blocks are not a multiple of 4 (tiles of 24, 40, 120
columns: B [N, K] with N itself as the tile), a chunk is 2 or 1 of them,
and with 1 half a warp's lanes idle."""

from __future__ import annotations

import re
import string
import textwrap

from .kernel_shape import dtype_bytes

CHUNK_BLOCKS = 4  # 8-column blocks a warp stages at a time (32 columns: 64 bytes of an fp16 row)
PREFETCH_BYTES = 128  # the rows' loads a thread issues before the products (32 registers)
WARPS = 8  # the two consumer warpgroups' warps
_ZERO = frozenset({"0", "T.int64(0)", "T.int32(0)"})  # a leading index a vector load may have

# The first epilogue: each thread's accumulators as they lie, two adjacent columns a store (its
# declarations: REGISTERS_DECLS)
REGISTERS_DECLS = 'wg_pair = T.alloc_local((2,), "$out_dtype")'
REGISTERS = '''for wg_hi in T.unroll((1 + wg_pp) * (wg_nacc // 4)):  # (h: the 64-row halves a warpgroup computes)
    wg_h = T.meta_var(wg_hi // (wg_nacc // 4))
    wg_i = T.meta_var(wg_hi % (wg_nacc // 4))
    for wg_r in T.unroll(2):
        wg_row = T.meta_var((wg_tile // wg_grid_n) * wg_bm + (wg_h + wg_g * (1 - wg_pp)) * 64
                            + (wg_tx % 128) // 32 * 16 + (wg_tx % 32) // 4 + wg_r * 8)
        wg_col = T.meta_var((wg_tile % wg_grid_n) * wg_bn + wg_i * 8 + (wg_tx % 4) * 2)
        if $in_bounds:  # (the epilogue reads per-row and per-column parameters: only what exists)
            for wg_c in T.unroll(2):
                wg_x = T.meta_var(wg_acc[wg_h * wg_nacc + wg_i * 4 + wg_r * 2 + wg_c])
                wg_colc = T.meta_var(wg_col + wg_c)
                wg_pair[wg_c] = T.Cast("$out_dtype", $expr)
            for wg_c in T.vectorized(2):
                $out[wg_row, wg_col + wg_c] = wg_pair[wg_c]
'''

# A thread's item: row `wg_q // wg_cb` of its warp's 16, 8-column block `wg_q % wg_cb` of chunk `wg_j`
_ROW = ("(wg_tile // wg_grid_n) * wg_bm + (wg_h + wg_g * (1 - wg_pp)) * 64 + (wg_tx % 128) // 32 * 16 "
        "+ wg_q // wg_cb")
_COL = "(wg_tile % wg_grid_n) * wg_bn + (wg_j * wg_cb + wg_q % wg_cb) * 8"

STAGED = string.Template('''for wg_hj in T.unroll((1 + wg_pp) * wg_chunks):
    wg_h = T.meta_var(wg_hj // wg_chunks)
    wg_j = T.meta_var(wg_hj % wg_chunks)
$chunk_loads
    for wg_b in T.unroll(wg_cb):  # (the chunk's accumulators to the warp's rows in shared memory)
        for wg_r in T.unroll(2):
            for wg_c in T.unroll(2):
                wg_two[wg_c] = wg_acc[wg_h * wg_nacc + (wg_j * wg_cb + wg_b) * 4 + wg_r * 2 + wg_c]
            for wg_c in T.vectorized(2):
                wg_stage[(wg_tx - 128) // 32, (wg_tx % 32) // 4 + wg_r * 8, wg_b * 8 + (wg_tx % 4) * 2 + wg_c] = \\
                    wg_two[wg_c]
    T.cuda.warp_sync()
    for wg_p in T.unroll(wg_passes):
        wg_q = T.meta_var(wg_p * 32 + wg_tx % 32)
        wg_row = T.meta_var($row)
        wg_col = T.meta_var($col)
        if T.And(wg_q < 16 * wg_cb, $in_bounds):
            for wg_u in T.unroll(2):
                for wg_c in T.vectorized(4):
                    wg_f[wg_u * 4 + wg_c] = wg_stage[(wg_tx - 128) // 32, wg_q // wg_cb, (wg_q % wg_cb) * 8 + wg_u * 4
                                                     + wg_c]
            for wg_e in T.unroll(8):
                wg_x = T.meta_var(wg_f[wg_e])
                wg_colc = T.meta_var(wg_col + wg_e)
                wg_vals[wg_e] = T.Cast("$out_dtype", $expr)
            for wg_u in T.unroll(8 // $out_vec):
                for wg_c in T.vectorized($out_vec):
                    $out[wg_row, wg_col + wg_u * $out_vec + wg_c] = wg_vals[wg_u * $out_vec + wg_c]
    T.cuda.warp_sync()
''')


class Load:
    """A load of the epilogue that becomes a vector load: `name`'s
    element at `index` (TVMScript, over `wg_row` and `wg_colc`), into the
    local `local`; `rows`: whether it reads the thread's row too (else the
    column alone: a bias)."""

    def __init__(self, text, name, index, dtype, local, rows):
        self.text, self.name, self.index, self.dtype, self.local, self.rows = text, name, index, dtype, local, rows


def vector_loads(expr: str, params, n: int) -> list[Load]:
    """The loads of `expr` (an epilogue over `wg_row`, `wg_colc`) that read
    8 adjacent columns in 16-byte aligned loads (two in fp32): those of an
    fp16 or fp32 parameter whose last dimension is N (a multiple of 8: the
    kernel's `fits`), at [`wg_row`, `wg_colc`] or [`wg_colc`], any leading
    indices 0."""
    shapes = {name: (shape, dtype) for name, shape, dtype in params}
    loads, seen = [], set()
    for found in re.finditer(r"\b([A-Za-z_]\w*)\[([^\[\]]*)\]", expr):
        name, index = found.group(1), [t.strip() for t in found.group(2).split(",")]
        if found.group(0) in seen or name not in shapes:
            continue
        shape, dtype = shapes[name]
        rows = len(index) >= 2 and index[-2] == "wg_row"
        lead = index[:-2] if rows else index[:-1]
        if index[-1] != "wg_colc" or not all(t in _ZERO for t in lead) or shape[-1] != n \
                or dtype not in ("float16", "float32") or len(shape) != len(index):
            continue
        seen.add(found.group(0))
        loads.append(Load(found.group(0), name, index, dtype, f"wg_v{len(loads)}", rows))
    return loads


def staged(p, bn: int, pingpong: bool, out_dtype: str, in_bounds: str) -> tuple[str, str, str, dict, int]:
    """The staged epilogue for a Plan `p` and tiles of `bn` columns: (the
    epilogue's text, the text issued at a tile's start before its products,
    the local and shared buffers' declarations, the constants, the shared
    memory bytes). Raises ValueError where CHUNK_BLOCKS is not 1, 2, 4 or
    8 (a warp's 32 lanes take whole rows of a chunk, or a chunk's 16 rows
    fit in one pass)."""
    if CHUNK_BLOCKS not in (1, 2, 4, 8):
        raise ValueError(f"CHUNK_BLOCKS = {CHUNK_BLOCKS}: 1, 2, 4 or 8")
    cb = next(c for c in (CHUNK_BLOCKS, 4, 2, 1) if (bn // 8) % c == 0)
    chunks, passes = bn // 8 // cb, max(1, 16 * cb // 32)
    stride = next(s for s in range(8 * cb, 8 * cb + 33) if s % 32 == 8)  # (writes' half-warps on distinct banks)
    loads = vector_loads(p.expr, p.params, p.n)
    row_bytes = sum(dtype_bytes(ld.dtype) for ld in loads if ld.rows) * 8 * (1 + pingpong) * chunks * passes
    prefetch = 0 < row_bytes <= PREFETCH_BYTES
    expr = p.expr
    decls = ['wg_stage = T.alloc_shared((8, 16, wg_stride), "float32")',
             'wg_two = T.alloc_local((2,), "float32")', 'wg_f = T.alloc_local((8,), "float32")',
             f'wg_vals = T.alloc_local((8,), "{out_dtype}")']
    rows, columns = [], []  # (each load's text: those of the thread's rows, those of its columns alone)
    for ld in loads:
        if ld.rows:
            slot = "((wg_h * wg_chunks + wg_j) * wg_passes + wg_p)" if prefetch else "wg_p"
            slots = (1 + pingpong) * chunks * passes if prefetch else passes
        else:  # (the column alone: the same for every pass of a chunk, 32 being a multiple of wg_cb)
            slot, slots = "0", 1
        decls.append(f'{ld.local} = T.alloc_local(({slots * 8},), "{ld.dtype}")')
        expr = re.sub(rf"(?<![\w.]){re.escape(ld.text)}", f"{ld.local}[{slot} * 8 + wg_e]", expr)
        vec = 16 // dtype_bytes(ld.dtype)
        index = ", ".join(ld.index[:-1] + [f"{'wg_col' if ld.rows else 'wg_col0'} + wg_u * {vec} + wg_c"])
        load = (f"for wg_u in T.unroll(8 // {vec}):\n"
                f"    for wg_c in T.vectorized({vec}):\n"
                f"        {ld.local}[{slot} * 8 + wg_u * {vec} + wg_c] = {ld.name}[{index}]\n")
        (rows if ld.rows else columns).append(load)
    tile = chunk = ""
    if rows:  # (every pass's rows, each in bounds)
        guarded = (f"for wg_p in T.unroll(wg_passes):\n    wg_q = T.meta_var(wg_p * 32 + wg_tx % 32)\n"
                   f"    wg_row = T.meta_var({_ROW})\n    wg_col = T.meta_var({_COL})\n"
                   f"    if T.And(wg_q < 16 * wg_cb, {in_bounds}):\n" + textwrap.indent("".join(rows), " " * 8))
        if prefetch:  # (every chunk of the tile's halves, before the products)
            tile = "for wg_h in T.unroll(1 + wg_pp):\n    for wg_j in T.unroll(wg_chunks):\n" + textwrap.indent(
                guarded, " " * 8)
        else:
            chunk = guarded
    if columns:  # (the first pass's columns are every pass's)
        col = _COL.replace("wg_q", "(wg_tx % 32)")
        chunk += f"wg_col0 = T.meta_var({col})\nif wg_col0 < wg_n:\n" + textwrap.indent("".join(columns), " " * 4)
    text = STAGED.substitute(chunk_loads=textwrap.indent(chunk, " " * 4).rstrip("\n"), row=_ROW, col=_COL, expr=expr,
                             out_vec=16 // dtype_bytes(out_dtype), out_dtype=out_dtype, in_bounds=in_bounds, out=p.out)
    consts = {"wg_cb": cb, "wg_chunks": chunks, "wg_passes": passes, "wg_stride": stride}
    return text, tile, "\n".join(decls), consts, WARPS * 16 * stride * 4
