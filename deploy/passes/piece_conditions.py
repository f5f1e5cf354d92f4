"""A kernel's conditions along a row made conditions of its vector pieces:
the workaround `VectorRows` (passes/gpu_movement.py) needs for
concatenations.

A concatenation along the row tests the element's position against each
input's first channel (`64 <= c`). Split into pieces of 8 (`c = p * 8 +
lane`), that test varies within a piece as TVM 0.27's vectorizer sees it: it
vectorizes before its simplifier turns `64 <= p * 8 + lane` (lane < 8) into
`8 <= p`, and a condition that varies within the vector makes it fall back
to a loop of scalars. Written as `8 <= c // 8` (the same for every element
where 64 is a multiple of 8), the simplifier makes it `8 <= p` before the
vectorizer runs, and each piece is one vector load from the input it lies
in (tests/passes/test_gpu_movement.py::test_tvms_vectorizer_gives_up_a_concatenations_piece
fails once TVM does this by itself).

TVM 0.27's Python has no TIR expression mutator, so the block's value is
rebuilt node by node (`_rebuilt`, `_piece_expr`): only the nodes above a
changed condition, and only kinds this knows (anything else above one: the
kernel is left as it is).
"""

from __future__ import annotations


def piece_conditions(func, var, lanes: int):
    """`func` (with one block, as `_injective_block` leaves it) with each
    comparison of the row's iterator `var` alone with a multiple of `lanes`
    in its conditions made one of the piece (`C <= v` as `C // lanes <= v //
    lanes`; with C a multiple of lanes the same for every element): a
    concatenation along the row tests its position against each input's
    first channel, and a condition that varies within a piece makes TVM's
    vectorizer give up the vector. After the piece's split the simplifier
    makes `(p * lanes + lane) // lanes` the piece `p`, and each piece is
    read and written as one vector. None where there is no such comparison,
    or where one lies under an expression this does not rebuild (a call
    other than `if_then_else`). Comparisons of other forms stay as they are
    (the vectorizer then gives the piece up, and the rule declines)."""
    try:
        body, changed = _rebuilt(func.body, lambda e: _piece_expr(e, var, lanes))
    except _NotRebuilt:
        return None
    return func.with_body(body) if changed else None


class _NotRebuilt(Exception):
    pass


def _rebuilt(stmt, rewrite):
    """(`stmt` with its one BufferStore's value rewritten, whether it
    changed): the loops and blocks above it rebuilt around it."""
    from ..tvm_compat import s_tir, tirx

    if isinstance(stmt, tirx.BufferStore):
        value, changed = rewrite(stmt.value)
        return (tirx.BufferStore(stmt.buffer, value, stmt.indices) if changed else stmt), changed
    if isinstance(stmt, tirx.For):
        body, changed = _rebuilt(stmt.body, rewrite)
        return (tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding,
                         stmt.annotations) if changed else stmt), changed
    if isinstance(stmt, s_tir.SBlockRealize):
        block, changed = _rebuilt(stmt.block, rewrite)
        return (s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block) if changed else stmt), changed
    if isinstance(stmt, s_tir.SBlock) and stmt.init is None:
        body, changed = _rebuilt(stmt.body, rewrite)
        return (s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, None, stmt.alloc_buffers,
                             stmt.match_buffers, stmt.annotations) if changed else stmt), changed
    raise _NotRebuilt(type(stmt).__name__)


def _piece_expr(expr, var, lanes: int):
    """(`expr` with the conditions of its `if_then_else`s and selects made
    the piece's, whether it changed); raises _NotRebuilt where a changed
    part lies under a node this does not rebuild."""
    from ..tvm_compat import tirx, tvm

    def walk(e):
        if isinstance(e, tvm.ir.Call):
            if e.op.name != "prim.if_then_else":
                if any(walk(a)[1] for a in e.args):
                    raise _NotRebuilt(e.op.name)
                return e, False
            (c, cc), (t, tc), (f, fc) = _piece_condition(e.args[0], var, lanes), walk(e.args[1]), walk(e.args[2])
            return (tirx.if_then_else(c, t, f) if cc or tc or fc else e), cc or tc or fc
        if isinstance(e, tirx.Select):
            (c, cc), (t, tc), (f, fc) = _piece_condition(e.condition, var, lanes), walk(e.true_value), walk(e.false_value)
            return (tirx.Select(c, t, f) if cc or tc or fc else e), cc or tc or fc
        if isinstance(e, tirx.Cast):
            v, changed = walk(e.value)
            return (tirx.Cast(e.ty, v) if changed else e), changed
        if isinstance(e, (tirx.expr.BinaryOpExpr, tirx.expr.CmpExpr, tirx.And, tirx.Or)):
            (a, ac), (b, bc) = walk(e.a), walk(e.b)
            return (type(e)(a, b) if ac or bc else e), ac or bc
        return e, False  # (a load, a constant, a variable: no condition in it)

    return walk(expr)


def _piece_condition(cond, var, lanes: int):
    """(`cond` with each comparison of `var` alone with a multiple of
    `lanes` made the piece's, whether it changed); other comparisons and
    terms stay as they are."""
    from ..tvm_compat import tirx

    if isinstance(cond, (tirx.And, tirx.Or)):
        (a, ac), (b, bc) = _piece_condition(cond.a, var, lanes), _piece_condition(cond.b, var, lanes)
        return (type(cond)(a, b) if ac or bc else cond), ac or bc
    if isinstance(cond, tirx.Not):
        a, changed = _piece_condition(cond.a, var, lanes)
        return (tirx.Not(a) if changed else cond), changed
    # C <= v and v >= C: v in the piece C // lanes or later; v < C and C > v: before it
    later = {tirx.LE: (0, 1), tirx.GE: (1, 0), tirx.LT: (1, 0), tirx.GT: (0, 1)}  # (the constant's side, v's)
    for kind, (c_side, v_side) in later.items():
        if isinstance(cond, kind):
            c, v = (cond.a, cond.b)[c_side], (cond.a, cond.b)[v_side]
            if isinstance(c, tirx.IntImm) and isinstance(v, tirx.Var) and v.same_as(var) and c.value % lanes == 0:
                piece = tirx.floordiv(v, tirx.IntImm(c.ty, lanes))  # (a comparison's sides share a type)
                bound = tirx.IntImm(c.ty, c.value // lanes)
                return kind(*((bound, piece) if c_side == 0 else (piece, bound))), True
    return cond, False
