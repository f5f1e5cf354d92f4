"""Workaround: TVM 0.27 puts two barriers in every K step of a `cp.async` pipeline.

Upstream symptom (TVM 0.27, CUDA, a software-pipelined GEMM whose shared
tiles are copied by `cp.async`: passes/mma_gemm.py's kernels, MetaSchedule's
tensor-core rules): the main loop's body is

    __syncthreads();                  // ThreadSync: before the copies overwrite a stage
    cp.async ... tile k + S - 1;  cp.async.commit_group;
    cp.async.wait_group c;  __syncthreads();   // the pipeline: tile k + S - 1 - c has landed
    ldmatrix / mma.sync on the landed tiles

ThreadSync cannot tell the stages of the ring apart, so it orders every
write after every read of the ring with a barrier of its own. Two barriers
a K tile hold the block's warps in step twice, each time with their
`ldmatrix` latency exposed together; a K tile of 32 is 64 `mma.sync` a
warp between barriers.

Fix (what CUTLASS's multistage main loop does): wait first, one barrier,
then the copies, then the compute:

    cp.async.wait_group c - 1;  __syncthreads();
    cp.async ... tile k + S - 1;  cp.async.commit_group;
    ldmatrix / mma.sync on the landed tiles

Why this is as safe as TVM's order, whatever the ring's size: the one
barrier of iteration k still comes after every read of iteration k - 1 and
before the copies of iteration k (what ThreadSync's barrier was for), and
after the wait (what the pipeline's was for). The wait comes before this
iteration's commit, so one group fewer may stay in flight for the same
tiles to have landed. The copies of iteration k were in flight during
iteration k's reads in TVM's order too, so nothing reads them earlier than
it did.

Scope: a device loop whose body is exactly that: a commit scope holding the
loop's first barrier, then only index bindings, then a wait scope opening
with the loop's only other barrier, c >= 1 (with c = 0 the wait would have
to wait for a group not yet committed). Anything else is left as TVM
lowered it. A scheduled function with the attribute `STOCK`
("deploy.stock_pipeline_sync": 1) is left alone too (the probes'
comparison), and every kernel is where the environment sets
`DEPLOY_PIPELINE_SYNC=stock` (a package built both ways, to measure it). `tests/passes/test_pipeline_sync.py` checks the
kernels in `tests/cuda_emu.py`'s emulation (results, races, copies read in
flight), and fails once TVM's own lowering puts one barrier in the loop.
"""

from __future__ import annotations

import os
import re

STOCK = "deploy.stock_pipeline_sync"
ENV = "DEPLOY_PIPELINE_SYNC"  # "stock": leave every kernel as TVM lowers it

_COMMIT = "async_commit_queue_scope"
_WAIT = "async_wait_queue_scope"
_INFLIGHT = "async_wait_inflight_count"


def stock_everywhere() -> bool:
    """Whether the environment asks for TVM's barriers in every kernel
    (`DEPLOY_PIPELINE_SYNC=stock`); any other value is refused."""
    value = os.environ.get(ENV, "")
    if value not in ("", "one", "stock"):
        raise ValueError(f"{ENV}={value!r} | expected 'stock' (TVM's two barriers a K step) or 'one' (the default)")
    return value == "stock"


def _is_sync(stmt) -> bool:
    from ..tvm_compat import tirx

    if not isinstance(stmt, tirx.stmt.Evaluate):
        return False
    value = stmt.value
    return getattr(getattr(value, "op", None), "name", None) == "tirx.tvm_storage_sync" and \
        str(value.args[0].value).startswith("shared")


def _stmt(parts: list):
    """A SeqStmt of `parts`, or its one statement (TVM refuses a SeqStmt of one)."""
    from ..tvm_compat import tirx

    return parts[0] if len(parts) == 1 else tirx.stmt.SeqStmt(parts)


def _seq(stmt) -> list:
    from ..tvm_compat import tirx

    return list(stmt.seq) if isinstance(stmt, tirx.stmt.SeqStmt) else [stmt]


def _rewrite_loop(loop):
    """The loop with its body in one-barrier order, or None where it is not
    the pattern or its stage indices do not prove the rewrite safe."""
    from ..tvm_compat import tirx

    body = _seq(loop.body)
    commits = [i for i, s in enumerate(body) if isinstance(s, tirx.stmt.AttrStmt) and s.attr_key == _COMMIT]
    waits = [i for i, s in enumerate(body) if isinstance(s, tirx.stmt.AttrStmt) and s.attr_key == _WAIT]
    if len(commits) != 1 or len(waits) != 1 or commits[0] > waits[0]:
        return None
    ci, wi = commits[0], waits[0]
    commit, wait = body[ci], body[wi]
    # between them only index arithmetic (bindings of values that load nothing), which moves ahead of the copies
    between = body[ci + 1:wi]
    if any(type(s).__name__ != "Bind" or "[" in str(s.value) or "access_ptr" in str(s.value) for s in between):
        return None
    copies = _seq(commit.body)
    syncs = [i for i, s in enumerate(copies) if _is_sync(s)]
    inflight = wait.body
    if len(syncs) != 1 or not (isinstance(inflight, tirx.stmt.AttrStmt) and inflight.attr_key == _INFLIGHT):
        return None
    count = int(inflight.value)
    after_wait = _seq(inflight.body)
    if count < 1 or not after_wait or not _is_sync(after_wait[0]):
        return None
    if any(_is_sync(s) for s in after_wait[1:]):
        return None
    # body[:ci] (bindings before the copies) stay first; the copies lose their barrier
    copies_scope = tirx.stmt.AttrStmt(commit.node, _COMMIT, commit.value,
                                      _stmt(copies[:syncs[0]] + copies[syncs[0] + 1:]))
    new_wait = tirx.stmt.AttrStmt(wait.node, _WAIT, wait.value, tirx.stmt.AttrStmt(
        inflight.node, _INFLIGHT, tirx.IntImm("int32", count - 1),
        _stmt([after_wait[0], copies_scope, *after_wait[1:]])))
    new_body = _stmt([*body[:ci], *between, new_wait, *body[wi + 1:]])
    return tirx.stmt.For(loop.loop_var, loop.min, loop.extent, loop.kind, new_body, loop.thread_binding,
                         loop.annotations)


def _rewrite(stmt, count: list):
    """`stmt` with every loop of the pattern rewritten (count[0] += each)."""
    from ..tvm_compat import tirx

    if isinstance(stmt, tirx.stmt.SeqStmt):
        parts = [_rewrite(s, count) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(parts, stmt.seq)) else tirx.stmt.SeqStmt(parts)
    if isinstance(stmt, tirx.stmt.AttrStmt):
        body = _rewrite(stmt.body, count)
        return stmt if body.same_as(stmt.body) else tirx.stmt.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if isinstance(stmt, tirx.stmt.IfThenElse):
        then = _rewrite(stmt.then_case, count)
        other = _rewrite(stmt.else_case, count) if stmt.else_case is not None else None
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.stmt.IfThenElse(stmt.condition, then, other)
    if isinstance(stmt, tirx.stmt.For):
        new = _rewrite_loop(stmt)
        if new is not None:
            count[0] += 1
            return new
        body = _rewrite(stmt.body, count)
        return stmt if body.same_as(stmt.body) else tirx.stmt.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations)
    return stmt


def apply(mod, skip: set[str] = frozenset()):
    """`mod` (lowered: device functions split out) with the loops of its
    device functions rewritten, except those of the kernels named in `skip`
    (TVM's `<name>_kernel...` of each). Returns (module, loops rewritten)."""
    from ..tvm_compat import tirx, tvm

    count = [0]
    funcs = {}
    for gv, f in mod.functions.items():
        if (isinstance(f, tirx.PrimFunc) and f.attrs and "calling_conv" in f.attrs
                and not any(re.fullmatch(re.escape(s) + r"_kernel(_\d+)?", gv.name_hint) for s in skip)):
            body = _rewrite(f.body, count)
            if not body.same_as(f.body):
                funcs[gv] = f.with_body(body)
    if not funcs:
        return mod, 0
    out = tvm.IRModule({**dict(mod.functions.items()), **funcs}, attrs=mod.attrs, global_infos=mod.global_infos)
    return out, count[0]
