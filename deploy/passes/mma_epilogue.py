"""Workaround: TVM 0.27's auto-copy lowering refuses an mma.sync kernel with a fused epilogue.

Upstream symptom (TVM 0.27, CUDA, MetaSchedule's `mma.sync` tensor-core rule):
  `memhammer_lower_auto_copy.cc:691: Check failed: (found) is false: Multiple buffer read`
The rule (m16n8k8 fed by `ldmatrix`, a `cp.async` pipeline in dynamic shared
memory) writes the `m16n8k8.matrixC` accumulator out through an "auto_copy"
block, and the kernel's epilogue (cast, bias add, ReLU: every convolution of
a CNN) is inlined into that block, which then reads the accumulator and the
bias. LowerAutoCopy accepts a second read only beside a `wmma.accumulator`,
though its mma path (stage the fragments in shared memory lane by lane, then
store to global with the epilogue applied) handles any epilogue. So every
candidate with an epilogue failed VerifyGPUCode, and the rule never gave a
CNN a kernel: 0 of 300 draws of a 4096^3 GEMM + bias + ReLU passed, against
12 of 300 of the bare GEMM (`python scripts/mma_probe.py --gemm ...`,
results/cpu/2026-12-03/mma-probe-gemm4096-*).

Fix: such a block declares only its accumulator read (its body, which still
reads the bias, is left as it is), the case LowerAutoCopy handles for WMMA.
Applied as a MetaSchedule postprocessor before VerifyGPUCode
(`postprocs()`, which runs TVM's own lowering on each candidate) and in our
TIR pipeline before TVM's (`deploy.passes.tensor_core_smem`), since a
record's trace, replayed by a build, does not carry the postprocessor's
change.

Scope: auto-copy blocks that read an `m16n8k8.matrixC` buffer and, besides,
only global buffers; nothing else is touched. `tests/passes/test_mma_epilogue.py` fails once
TVM lowers such a block as it is.
"""

from __future__ import annotations

ACCUMULATOR = "m16n8k8.matrixC"


def _blocks(stmt) -> list:
    """Every SBlock under `stmt` (TVM 0.27 exposes no TIR visitor to Python)."""
    from ..tvm_compat import s_tir, tirx

    out, todo = [], [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, s_tir.stmt.SBlockRealize):
            node = node.block
        if isinstance(node, s_tir.stmt.SBlock):
            out.append(node)
            todo += [node.body] + ([node.init] if node.init is not None else [])
        elif isinstance(node, tirx.stmt.SeqStmt):
            todo += list(node.seq)
        elif isinstance(node, tirx.stmt.IfThenElse):
            todo += [node.then_case] + ([node.else_case] if node.else_case is not None else [])
        elif hasattr(node, "body"):
            todo.append(node.body)
    return out


def _needs_it(block) -> bool:
    """An auto-copy block reading an mma accumulator and, besides, only
    global buffers (the epilogue's operands: bias, residual)."""
    scopes = [r.source.scope() for r in block.reads]
    return (bool(block.annotations.get("auto_copy")) and len(scopes) > 1 and ACCUMULATOR in scopes
            and all(s in (ACCUMULATOR, "global") for s in scopes))


def declare_accumulator_reads(sch) -> int:
    """Rewrite, in the schedule `sch`, each auto-copy block that reads an
    mma accumulator and more to declare the accumulator read only; returns
    how many were rewritten."""
    from ..tvm_compat import s_tir

    n = 0
    for gv, func in sch.mod.functions.items():
        if not hasattr(func, "body"):
            continue
        for block in _blocks(func.body):
            if not _needs_it(block):
                continue
            acc = [r for r in block.reads if r.source.scope() == ACCUMULATOR]
            new = s_tir.stmt.SBlock(block.iter_vars, acc, block.writes, block.name_hint, block.body, block.init,
                                    block.alloc_buffers, block.match_buffers, block.annotations)
            sref = sch.get_sref(sch.get_sblock(block.name_hint, func_name=gv.name_hint))
            sch.state.replace(sref, new, {block: new})
            n += 1
    return n


def apply_to_func(func):
    """`func` with declare_accumulator_reads() applied (itself where nothing needs it)."""
    from ..tvm_compat import s_tir, tvm

    if not any(_needs_it(b) for b in _blocks(func.body)):
        return func
    sch = s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0)
    declare_accumulator_reads(sch)
    return sch.mod["main"]


def postprocs(target):
    """The target's MetaSchedule postprocessors, with the fix before
    VerifyGPUCode on CUDA ("from-target" elsewhere: the target's defaults),
    RewriteTensorize moved before VerifyGPUCode (see below), and
    VerifyGPUCode judging tensor-core kernels by their own limit."""
    from ..tvm_compat import derived_object, ms

    if target.kind.name != "cuda":
        return "from-target"

    @derived_object
    class DeclareMmaEpilogueReads(ms.postproc.PyPostproc):
        def _initialize_with_tune_context(self, context):
            pass

        def apply(self, sch) -> bool:
            try:
                declare_accumulator_reads(sch)
            except Exception as e:  # noqa: BLE001 - never worse than without it: VerifyGPUCode judges
                _warn_once(e)
            return True

        def clone(self):
            return DeclareMmaEpilogueReads()

    out = list(ms.postproc.Postproc.create("cuda-tensorcore"))
    # Workaround (TVM 0.27): VerifyGPUCode comes before RewriteTensorize in
    # TVM's list, and lowering a WMMA candidate whose fragments are not yet
    # tensorized fails ("Cannot find shape of the wmma fragment
    # C_reindex_shared_dyn_wmma_accumulator"), though such a draw builds
    # once tensorized. Run after it, VerifyGPUCode (lowered as our pipeline
    # lowers tensor-core kernels: mma_gemm.verify_postproc) passed 27, 24
    # and 41 of 64 draws of three GEMMs + bias + ReLU where TVM's order
    # passed 9, 8 and 18, and none fewer; 56 of the 57 more built
    # (results/cpu/2026-12-04/wmma-verify-order/).
    # tests/passes/test_mma_epilogue.py fails once TVM lowers such a draw
    # before it is tensorized.
    at = next((k for k, p in enumerate(out) if "VerifyGPUCode" in str(type(p)) or "VerifyGPUCode" in str(p)),
              len(out))
    tensorize = [p for p in out[at + 1:] if "RewriteTensorize" in str(type(p))]
    before, after = out[:at], [p for p in out[at + 1:] if p not in tensorize]
    verify = []
    if at < len(out):  # (with our mma.sync GEMM's shared-memory limit: passes/mma_gemm.py)
        from . import mma_gemm

        verify = [mma_gemm.verify_postproc(target)]
    return before + [DeclareMmaEpilogueReads()] + tensorize + verify + after


_warned: list = []


def _warn_once(e: Exception) -> None:
    import logging

    from ..errors import error_line

    if not _warned:
        _warned.append(e)
        logging.getLogger(__name__).warning("mma_epilogue: postprocessor failed (%s); candidates left as they are",
                                            error_line(e, 200))
