"""How the wgmma kernel (passes/wgmma_gemm.py) reads a GEMM's A when a
producer block makes it: pad_gemm's row padding of a parameter (TMA reads
the rows past the end as zeros: `padded_rows`), or an implicit GEMM's
gather of the activations, which its producer warpgroup copies by
`cp.async` (`gather`: the gather's own index and condition as TVMScript
text over the kernel's row and K, checked by evaluating them; `producer`:
that warpgroup's part of the kernel). Read from the fused function's
printed blocks: TVM 0.27 has no Python IR mutator."""

from __future__ import annotations

import math
import re
import string
import textwrap
from typing import NamedTuple


class Gather(NamedTuple):
    """An implicit GEMM's A [`wg_arow`, `wg_ak`] as the kernel's producer
    copies it, 8 elements at a time from a multiple of 8 of K: the
    activations' element `row_offset + k_offset` (flat) where `row_cond`,
    `k_cond` and, for each of `checks` (a row's part, a K's part, a size),
    0 <= the two parts' sum < size hold; else zeros. The row's texts are
    over `wg_arow`, the K's over `wg_ak`, in `dtype`: a thread computes a
    row's once a tile for each of its rows, a K's once a stage."""

    dtype: str
    row_offset: str
    k_offset: str
    row_cond: str
    k_cond: str
    checks: tuple[tuple[str, str, int], ...]


def gather(blk, names, rows: int, k: int) -> Gather | None:
    """The Gather where a producer block gathers A [rows, k] from a 4-D fp16
    parameter, as an implicit GEMM's im2col does (`A[i, k] =
    if_then_else(cond, x[index], 0)`, the conditions of pad_gemm's row
    padding around it), and each 8 elements of A's row from a multiple of 8
    lie side by side in the parameter's last dimension from a multiple of 8
    (one aligned 16-byte copy); else None. Each index must be a part of the
    row plus a part of K (a convolution's input row is its output row times
    the stride plus the filter's row, less the padding), and each condition
    on the row alone, on K alone, or, all such together, that the indices
    lie inside the parameter (the padding). Which indices the copy checks is
    found from every row's part and every K's; the rest is checked by
    evaluating the block's own texts (NumPy) over every k on rows at both
    ends, between, and where each index's row part is least and greatest."""
    import numpy as np

    if len(blk.iter_vars) != 2:
        return None
    x = str(blk.reads[0].source)
    if x not in names or len(names[x][0]) != 4 or names[x][1] != "float16" or names[x][0][3] % 8:
        return None
    v0, v1 = (str(v.var) for v in blk.iter_vars)
    text = blk.body.value.script(show_meta=False).strip().splitlines()[-1]
    conds = []
    while text.startswith("T.if_then_else(") and text.endswith(")"):
        args = _split(text[len("T.if_then_else("):-1], ",")
        if args is None or len(args) != 3 or not re.fullmatch(r"T\.float16\(0(?:\.0)?\)", args[2]):
            return None
        conds += _split(args[0], " and ") or [args[0]]
        text = args[1]
    found = re.fullmatch(rf"{re.escape(x)}\[(.*)\]", text)
    index = _split(found.group(1), ",") if found else None
    if index is None or len(index) != 4:
        return None
    shape = names[x][0]
    # the conditions: on the row alone (pad_gemm's), on K alone, or on both (the convolution's padding)
    kinds = ["k" if not re.search(rf"\b{v0}\b", t) else "row" if not re.search(rf"\b{v1}\b", t) else "both"
             for t in conds]
    try:  # (NumPy arrays for v0 and v1: the printed // and % are floor division and modulo, as NumPy's)
        def ev(t, i, j):
            plain = re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", t)
            if "T." in plain or not re.fullmatch(r"[\w\s()+\-*/%<>=!]+", plain):
                raise ValueError(t)
            return np.broadcast_to(eval(plain, {"__builtins__": {}}, {v0: i, v1: j}), np.broadcast(i, j).shape)

        # Every row's part of each index (at K 0) where the row's conditions hold, and every K's (less its
        # value at row 0, K 0) where K's hold: where both parts are sums (checked below), an index leaves the
        # parameter on some row and K exactly where the least or the greatest sum does. Those rows join the
        # sampled ones (both ends, and between).
        rows_all, ks_all = np.arange(rows)[:, None], np.arange(k)[None, :]
        row_held = np.logical_and.reduce([np.ones(rows, bool)] + [ev(t, rows_all, 0)[:, 0].astype(bool)
                                                                  for t, kind in zip(conds, kinds) if kind == "row"])
        k_held = np.logical_and.reduce([np.ones(k, bool)] + [ev(t, 0, ks_all)[0].astype(bool)
                                                             for t, kind in zip(conds, kinds) if kind == "k"])
        row_part = [ev(t, rows_all, 0)[:, 0] for t in index]
        k_part = [ev(t, 0, ks_all)[0] - ev(t, 0, 0) for t in index]
        if not row_held.any() or not k_held.any():
            return None
        ends = [np.flatnonzero(row_held)[f(r[row_held])] for r in row_part for f in (np.argmin, np.argmax)]
        sampled = np.random.default_rng(0).integers(0, rows, 32)
        i = np.unique(np.r_[0:min(rows, 3), max(rows - 3, 0):rows, sampled, ends])
        i, j = i[:, None], np.arange(k)[None, :]
        held = [ev(t, i, j).astype(bool) for t in conds]
        idx = [ev(t, i, j) for t in index]
    except Exception:  # noqa: BLE001 - a form not foreseen: declined
        return None
    ok = np.logical_and.reduce([*held, np.ones((i.size, k), bool)])
    base = j - j % 8
    side_by_side = all(np.array_equal(d[:, base[0]] + (j[0] % 8 if n == 3 else 0), d) for n, d in enumerate(idx))
    outside = [(d < 0) | (d >= size) for d, size in zip(idx, shape)]
    _, h, w, c = shape
    offset = ((idx[0] * h + idx[1]) * w + idx[2]) * c + idx[3]  # (a copy's first element: 16-byte aligned)
    aligned = np.all((offset[:, base[0]] % 8 == 0) | ~ok)
    if not side_by_side or not np.array_equal(ok[:, base[0]], ok) or np.any(np.logical_or.reduce(outside) & ok) \
            or not aligned or not all(np.array_equal(r[i] + q[None, :], d) for r, q, d in zip(row_part, k_part, idx)):
        return None
    # the conditions on both must say, where the row's and K's hold, that the indices that ever leave the
    # parameter there lie inside it (what the copy checks)
    alone = np.logical_and.reduce([np.ones_like(ok), *(v for v, kind in zip(held, kinds) if kind != "both")])
    joint = np.logical_and.reduce([np.ones_like(ok), *(v for v, kind in zip(held, kinds) if kind == "both")])
    checked = [n for n, (r, q, size) in enumerate(zip(row_part, k_part, shape))
               if r[row_held].min() + q[k_held].min() < 0 or r[row_held].max() + q[k_held].max() >= size]
    inside = ~np.logical_or.reduce([np.zeros_like(ok), *(outside[n] for n in checked)])
    if not np.array_equal(joint & alone, inside & alone):
        return None

    # A thread computes the K's part once a stage and the conditions for each 16-byte copy (8 a stage), where
    # 64-bit division by a constant costs several times 32-bit's: in int32 where every value fits (the
    # parameter's elements, and each text evaluated in int32 on the rows and K above gives what it gives in
    # int64), else in the block's index type, the kernel's row and K cast to it (TVMScript compares only
    # equal types).
    texts = [*conds, *index]
    dtype = str(blk.iter_vars[0].var.ty)
    narrow = [re.sub(r"T\.int64\((-?\d+)\)", r"\1", t) for t in texts]
    if int(np.prod(shape)) < 2**30 and not any("int64" in t for t in narrow):  # (2^30: rows past M's too)
        i32, j32 = i.astype(np.int32), j.astype(np.int32)
        with np.errstate(over="ignore"):
            if all(np.array_equal(ev(t, i32, j32), ev(t, i, j)) for t in narrow):
                texts, dtype = narrow, "int32"
    conds, index = texts[:len(conds)], texts[len(conds):]
    row, kk, zero, lit = (("wg_arow", "wg_ak", "0", str) if dtype == "int32" else
                          (*(f'T.Cast("{dtype}", {v})' for v in ("wg_arow", "wg_ak")), f"T.{dtype}(0)",
                           lambda n: f"T.{dtype}({n})"))

    def at(t, r, q):  # (`t` with the block's row and K replaced)
        return re.sub(rf"\b{v0}\b", r, re.sub(rf"\b{v1}\b", q, t))

    def flat(r, q):
        i0, i1, i2, i3 = (f"({at(t, r, q)})" for t in index)
        return f"(({i0} * {lit(h)} + {i1}) * {lit(w)} + {i2}) * {lit(c)} + {i3}"

    def holds(kind):
        return " and ".join(f"({at(t, row, kk)})" for t, of in zip(conds, kinds) if of == kind) or "T.bool(True)"

    return Gather(dtype, flat(row, zero), f"{flat(zero, kk)} - ({flat(zero, zero)})", holds("row"), holds("k"),
                  tuple((at(index[n], row, zero), f"{at(index[n], zero, kk)} - ({at(index[n], zero, zero)})",
                         shape[n]) for n in checked))


# A gathered (an implicit GEMM's im2col): the producer warpgroup copies the stage's 128 rows of eight
# 16-byte chunks by cp.async, eight neighbouring threads a row (chunk tx % 8 of rows tx // 8, + 16, ...:
# a warp reads four rows' 128 contiguous bytes each at once), zero-filled where the gather reads padding,
# rows past M or K past its end, to where TMA's 128-byte swizzle puts them (chunk c of row r at
# c ^ r % 8); each thread then arrives on the stage's `full` barrier when its copies land (.noinc: the
# barrier counts those 128 arrivals); the first thread loads B by TMA (the kernel's `b_load`). The
# gather's index is a part of the row plus a part of K (`Gather`): a thread computes its 8 rows' parts once a
# tile (their offsets, the parts of the indices it checks, and which rows hold, as bits), and K's once a
# stage, so that each copy adds, compares and selects (the division by the image's sizes for each copy
# made the producer, not the tensor cores, the limit: results/h100/2026-12-06/ragged-n-and-gathers/).
_PRODUCER = '''wg_roff = T.alloc_local((wg_bm // 16,), "$g_dtype")
wg_rchk = T.alloc_local((wg_bm // 16 * wg_nchk + 1,), "$g_dtype")
wg_kv = T.alloc_local((wg_nchk + 1,), "$g_dtype")
wg_bits = T.alloc_local((2,), "int32")
for wg_t in T.serial(wg_my_tiles):
    wg_tile = T.meta_var(wg_cta + wg_t * wg_ctas)
    wg_bits[0] = 0
    for wg_j in T.unroll(wg_bm // 16):
        wg_arow = T.meta_var((wg_tile // wg_grid_n) * wg_bm + wg_j * 16 + wg_tx // 8)
        wg_roff[wg_j] = $g_row_offset
        $g_row_checks
        if T.And(wg_arow < wg_m, $g_row_cond):
            wg_bits[0] = T.bitwise_or(wg_bits[0], T.shift_left(1, wg_j))
    for wg_kt in T.serial(wg_k_tiles):
        wg_it = T.meta_var(wg_t * wg_k_tiles + wg_kt)
        wg_ak = T.meta_var(wg_kt * wg_bk + wg_tx % 8 * 8)
        wg_kv[0] = $g_k_offset
        $g_k_checks
        wg_bits[1] = T.Cast("int32", T.And(wg_ak < wg_k, $g_k_cond))
        T.cuda.mbarrier_wait(wg_empty.ptr_to([wg_it % wg_stages]), (wg_it // wg_stages) % 2 ^ 1)
        if wg_tx == 0:
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(wg_full.ptr_to([wg_it % wg_stages]), T.uint32(wg_b_bytes))
$b_load
        for wg_j in T.unroll(wg_bm // 16):
            wg_r = T.meta_var(wg_j * 16 + wg_tx // 8)
            wg_ok = T.meta_var(T.And(T.And(wg_bits[1] != 0, T.bitwise_and(T.shift_right(wg_bits[0], wg_j), 1) != 0),
                                     $g_inside))
            T.ptx["cp.async.cg.shared.global"](
                wg_as.ptr_to([wg_it % wg_stages, wg_r, T.bitwise_xor(wg_tx % 8, wg_r % 8) * 8]),
                wg_xf.ptr_to([T.if_then_else(wg_ok, wg_roff[wg_j] + wg_kv[0], $g_zero)]), 16,
                T.if_then_else(wg_ok, T.uint32(16), T.uint32(0)))
        T.ptx["cp.async.mbarrier.arrive.noinc.shared.b64"](wg_full.ptr_to([wg_it % wg_stages]))
T.ptx["cp.async.wait_all"]()  # (no copy left in flight when the thread ends)'''


def producer(g: Gather, x: str, x_shape, b_load: str) -> tuple[str, str, dict]:
    """The gathering producer for passes/wgmma_gemm.py's kernel: the text
    that views the activations `x` (of `x_shape`) flat, the producer's
    text (`b_load`: the kernel's TMA load of B, which the first thread
    issues), and the values of its `$` names."""
    unsigned = "uint32" if g.dtype == "int32" else "uint64"
    a_map = f'    wg_xf = T.decl_buffer(({math.prod(x_shape)},), "float16", data={x}.data)'
    text = string.Template(_PRODUCER).safe_substitute(b_load=textwrap.indent(b_load, " " * 12))
    return a_map, text, {
        "g_dtype": g.dtype, "g_row_offset": g.row_offset, "g_k_offset": g.k_offset, "g_row_cond": g.row_cond,
        "g_k_cond": g.k_cond, "g_zero": f"T.{g.dtype}(0)", "x": x,
        "g_row_checks": ("\n" + " " * 16).join(f"wg_rchk[wg_j * wg_nchk + {c}] = {row}"
                                               for c, (row, _, _) in enumerate(g.checks)),
        "g_k_checks": ("\n" + " " * 16).join(f"wg_kv[{c + 1}] = {kk}" for c, (_, kk, _) in enumerate(g.checks)),
        "g_inside": " and ".join(f'(T.Cast("{unsigned}", wg_rchk[wg_j * wg_nchk + {c}] + wg_kv[{c + 1}]) < '
                                 f"T.{unsigned}({size}))" for c, (_, _, size) in enumerate(g.checks))
        or "T.bool(True)"}


def _split(text: str, sep: str) -> list[str] | None:
    """`text` split at each `sep` outside brackets, or None where its
    brackets do not balance."""
    parts, depth, start, pos = [], 0, 0, 0
    while pos < len(text):
        ch = text[pos]
        depth += (ch in "([") - (ch in ")]")
        if depth < 0:
            return None
        if depth == 0 and text.startswith(sep, pos):
            parts.append(text[start:pos].strip())
            pos += len(sep)
            start = pos
            continue
        pos += 1
    return None if depth else [*parts, text[start:].strip()]


def padded_rows(blk) -> int | None:
    """The rows of A where a producer block is pad_gemm's row padding of a
    2-D parameter, `P[v0, v1] = if_then_else(v0 < rows, A[v0, v1], 0)`,
    else None."""
    if len(blk.iter_vars) != 2:
        return None
    v0, v1 = (re.escape(str(v.var)) for v in blk.iter_vars)
    src = re.escape(str(blk.reads[0].source))
    text = blk.body.value.script(show_meta=False).strip().splitlines()[-1]
    found = re.fullmatch(rf"T\.if_then_else\({v0} < (?:T\.int64\()?(\d+)\)?, {src}\[{v0}, {v1}\], "
                         rf"T\.float16\(0(?:\.0)?\)\)", text)
    return int(found.group(1)) if found else None
