"""How the wgmma kernel (passes/wgmma_gemm.py) reads a GEMM's A when a
producer block makes it: pad_gemm's row padding of a parameter (TMA reads
the rows past the end as zeros: `padded_rows`), or an implicit GEMM's
gather of the activations, which its producer warpgroup copies by
`cp.async` (`gather`: the gather's own index and condition as TVMScript
text over the kernel's row and K, checked by evaluating them). Read from
the fused function's printed blocks: TVM 0.27 has no Python IR mutator."""

from __future__ import annotations

import re


def gather(blk, names, rows: int, k: int):
    """(condition, index texts) over `wg_arow` and `wg_ak` where a producer
    block gathers A [rows, k] from a 4-D fp16 parameter, as an implicit
    GEMM's im2col does (`A[i, k] = if_then_else(cond, x[index], 0)`, the
    conditions of pad_gemm's row padding around it), and each 8 elements
    of A's row from a multiple of 8 lie side by side in the parameter's
    last dimension from a multiple of 8 (one aligned 16-byte copy); else
    None. That is checked by evaluating the block's own index and condition
    (NumPy) on rows at both ends and between, over every k."""
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
    try:  # (NumPy arrays for v0 and v1: the printed // and % are floor division and modulo, as NumPy's)
        def ev(t, i, j):
            plain = re.sub(r"T\.int(?:32|64)\((-?\d+)\)", r"\1", t)
            if "T." in plain or not re.fullmatch(r"[\w\s()+\-*/%<>=!]+", plain):
                raise ValueError(t)
            return np.broadcast_to(eval(plain, {"__builtins__": {}}, {v0: i, v1: j}), np.broadcast(i, j).shape)

        i = np.unique(np.r_[0:min(rows, 3), max(rows - 3, 0):rows, np.random.default_rng(0).integers(0, rows, 8)])
        i, j = i[:, None], np.arange(k)[None, :]
        ok = np.logical_and.reduce([ev(c, i, j).astype(bool) for c in conds]) if conds else np.ones((i.size, k), bool)
        idx = [ev(t, i, j) for t in index]
    except Exception:  # noqa: BLE001 - a form not foreseen: declined
        return None
    base = j - j % 8
    side_by_side = all(np.array_equal(d[:, base[0]] + (j[0] % 8 if n == 3 else 0), d) for n, d in enumerate(idx))
    inside = all(np.all((d >= 0) & (d < size) | ~ok) for d, size in zip(idx, names[x][0]))
    _, h, w, c = names[x][0]
    offset = ((idx[0] * h + idx[1]) * w + idx[2]) * c + idx[3]  # (a copy's first element: 16-byte aligned)
    aligned = np.all((offset[:, base[0]] % 8 == 0) | ~ok)
    if not side_by_side or not np.array_equal(ok[:, base[0]], ok) or not inside or not aligned:
        return None

    # The producer computes these for each 16-byte copy (8 a thread a stage), where 64-bit division by a
    # constant costs several times 32-bit's: in int32 where every value fits (the parameter's elements,
    # and each text evaluated in int32 on the rows and K above gives what it gives in int64), else in the
    # block's index type, the kernel's row and K cast to it (TVMScript compares only equal types).
    narrow = [re.sub(r"T\.int64\((-?\d+)\)", r"\1", t) for t in [*conds, *index]]
    dtype = str(blk.iter_vars[0].var.ty)
    if int(np.prod(names[x][0])) < 2**31 and not any("int64" in t for t in narrow):
        i32, j32 = i.astype(np.int32), j.astype(np.int32)
        with np.errstate(over="ignore"):
            if all(np.array_equal(ev(t, i32, j32), ev(t, i, j)) for t in narrow):
                conds, index, dtype = narrow[:len(conds)], narrow[len(conds):], "int32"

    row, kk = ("wg_arow", "wg_ak") if dtype == "int32" else (f'T.Cast("{dtype}", {v})' for v in ("wg_arow", "wg_ak"))

    def kernel_vars(t):
        return re.sub(rf"\b{re.escape(v0)}\b", row, re.sub(rf"\b{re.escape(v1)}\b", kk, t))

    return " and ".join(f"({kernel_vars(c)})" for c in conds) or "T.bool(True)", [kernel_vars(t) for t in index]


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
