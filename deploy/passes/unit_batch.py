"""A GEMM over `[1, M, K]` rows as one over `[M, K]`, for our default GEMM.

A transformer at batch 1 computes its dense layers as matmuls of a
`[1, tokens, K]` activation by a `[K, N]` weight: ViT-S/16's 197 tokens,
Swin's 196 and 49. Our `mma.sync` GEMM (passes/mma_gemm.py) takes 2-D GEMMs
only, and these kernels went to DLight's Matmul: on an H100, untuned,
ViT-S/16 at batch 1 ran 1.053 ms against torch.compile's 1.090
(results/h100/2026-12-06/four-models-untuned/), where on 2-D GEMMs of 196
rows our default tiles took 12.9 us a call against DLight's 82-95
(results/h200/2026-12-04/small-row-gemm-probe/). Where the wgmma kernel
takes the rows (a multiple of 16), the optimize stage makes such a matmul
2-D in the graph (passes/flat_gemm.py); 197 rows it does not take, and a
graph rewrite would give the kernel another workload, which the committed
databases have no record of.

So the kernel stays as it is, and `as_2d` rewrites only its blocks, with
schedule primitives: A's reads go through a 2-D copy of A (`reindex`, then
`transform_layout`; the schedule stages that copy in shared memory as it
does pad_gemm's padding), the GEMM's iterations become `[M, N, K]`
(`transform_block_layout`), and so do the element-wise blocks after it,
their intermediate buffers 2-D; the last one writes the output parameter at
`[0, i, j]`. The PrimFunc's parameters, and so its call and its tuning
records, are unchanged: the build's chain (passes/schedule.py) tries a
tuning record on the kernel as it is first, and gives our default schedule
only where there is none. Tuning's design spaces (`mma_gemm.spaces`) do
not use this: a trace has to replay from the workload itself.
"""

from __future__ import annotations

from .kernel_shape import point_indices, static_int

MARK = "deploy.unit_batch"  # block annotation: A's 2-D copy
# False: no kernel rewritten (what the chain did before; `bash scripts/gpu_ab.sh vit 1 new: off:unit_batch.ENABLED=False`
# measures the difference in a package).
ENABLED = True


def as_2d(func):
    """`func` (a PrimFunc) with its one GEMM over a unit leading axis, and the
    element-wise blocks after it, computed over 2-D iterations, else None:
    the GEMM block iterates [1, M, N, K] (spatial, spatial, spatial,
    reduction), reads A at [b, i, k] and a 2-D B, and writes C at [b, i, j];
    every block after it is spatial over [1, M, N]; no block before it."""
    from ..tvm_compat import s_tir, tirx, tvm

    if not ENABLED or not isinstance(func, tirx.PrimFunc):
        return None
    try:
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), debug_mask=0)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
    except Exception:  # noqa: BLE001 - no root block: not a kernel of this shape
        return None
    stmts = [sch.get(b) for b in blocks]
    kinds = [[int(v.iter_type) for v in s.iter_vars] for s in stmts]
    if not stmts or kinds[0] != [0, 0, 0, 2] or any(k != [0, 0, 0] for k in kinds[1:]):
        return None
    main = stmts[0]
    extents = [static_int(v.dom.extent) for v in main.iter_vars]
    if None in extents or extents[0] != 1 or len(main.reads) != 2 or len(main.writes) != 1:
        return None
    b, i, j, k = (str(v.var) for v in main.iter_vars)
    a_read, b_read = main.reads
    if [str(x) for x in point_indices(a_read)] != [b, i, k] \
            or [str(x) for x in point_indices(main.writes[0])] != [b, i, j] or len(b_read.source.shape) != 2:
        return None
    m = extents[1]
    for s in stmts[1:]:
        if [static_int(v.dom.extent) for v in s.iter_vars] != extents[:3] or len(s.writes) != 1:
            return None
    params = list(func.params)

    def is_param(buf) -> bool:
        return any(p.same_as(buf) for p in params)

    try:
        copy = sch.reindex(blocks[0], ("read", 0))
        sch.annotate(copy, MARK, 1)  # (pad_gemm.pad_rows_in inlines it into the rows' padding, as an im2col)
        if is_param(main.writes[0].source):  # (no epilogue: a copy out of a 2-D C becomes one)
            sch.reindex(blocks[0], ("write", 0))
        sch.transform_layout(blocks[0], ("read", 0), lambda b_, i_, k_: (b_ * m + i_, k_))
        sch.transform_layout(blocks[0], ("write", 0), lambda b_, i_, j_: (b_ * m + i_, j_))
        sch.transform_block_layout(blocks[0], lambda b_, i_, j_, k_: (b_ * m + i_, j_, k_))
        for blk in sch.get_child_blocks(sch.get_sblock("root")):
            s = sch.get(blk)
            if len(s.iter_vars) != 3 or any(int(v.iter_type) for v in s.iter_vars) or MARK in s.annotations:
                continue  # (the GEMM, A's copy)
            sch.transform_block_layout(blk, lambda b_, i_, j_: (b_ * m + i_, j_))
            out = sch.get(blk).writes[0].source
            if not is_param(out) and len(out.shape) == 3:
                sch.transform_layout(blk, ("write", 0), lambda b_, i_, j_: (b_ * m + i_, j_))
    except Exception:  # noqa: BLE001 - a ScheduleError: not a kernel this rewrite takes
        return None
    return sch.mod["main"]
