"""A CPU GEMM's constant weight packed into column panels of one tile's
width, so that each step of the tile's reduction reads one contiguous run.

The default CPU schedule of a matmul (cpu_default.py) computes a tile of 8
rows x 2 vectors of output columns (32 floats with AVX-512), running the
whole reduction inside the tile: each step loads 2 vectors of the weight
row `k` and broadcasts 8 values of the input. With the weight as the model
stores it ([K, N], or [N, K] for a transposed dense), consecutive steps read
rows N floats apart: a new page every step or two, which the hardware
prefetchers do not follow, so the tile waits on L2 and L3. ViT-S/16's
GEMMs ran at 145-180 GFLOP/s on the 2-core CPU machine, about half of ONNX
Runtime's rate.

This pass, last in the CPU profile's optimize stage, rewrites each kernel
that the default schedule takes where that operand (the one its vector
axis reads) is a 2-D constant whose other axis is the reduction, and its
columns divide into whole tiles:

- the constant is laid out [N / w, K, w] (`w`: the tile's width), folded in
  NumPy by fold_weights (a layout_transform of a constant);
- the kernel reads it there, and computes its product over [.., N / w, w]
  (transform_block_layout, then transform_layout of the weight and of the
  product), so that the product is still an einsum: `pad_einsum` can then
  pad ragged rows (ViT's 197 tokens) as cpu_default does;
- the elementwise blocks after the product (bias, GELU, a residual) iterate
  the panels too (`_split_chain`), so the default schedule still applies
  them as each tile is written back. Where the product is the kernel's
  output, it is staged over the panels (reindex) and the copy out is the
  tile's write-back; where a block after it is not elementwise over it, the
  product is staged the same way and that block runs after the tiles.

Per kernel on the CPU machine (2 cores, AVX-512), default schedule both
ways (results/cpu/2026-12-07/pack-weights/): ViT's fc1 (197 x 384 x 1536 +
GELU) 1.749 -> 1.077 ms, fc2 1.630 -> 1.089 ms, MLP-Mixer's channel MLPs
1.4x, weights that stay in L2 (BERT's 256 x 256) 1.00x-1.09x, none slower;
ViT-S/16 2.33x -> 1.54x ONNX Runtime's time, Swin-T 1.64x -> 1.13x.

A packed kernel is a new tuning workload: tuning records of the unpacked one
no longer match it (of the committed CPU databases, BERT's dense layers).
Kernels with the weight not a constant at every call (a
shared PrimFunc), or whose packed form the default schedule would not take,
are left as they are. `PACK = False` turns the pass off (A/B runs).
"""

from __future__ import annotations

import collections
import logging

from .kernel_shape import point_indices, rule_kernel, static_int

log = logging.getLogger(__name__)

PACK = True
ATTR = "deploy.packed_weight"  # on a packed kernel: its panels' width


def pack_gemm_weights(target):
    """The module pass for `target` (an llvm TVM target)."""
    from ..tvm_compat import RelaxConstant, relax, tvm

    @tvm.transform.module_pass(opt_level=0, name="pack_gemm_weights")
    def run(mod, _ctx):
        if not PACK or target.kind.name != "llvm":
            return mod
        calls = collections.defaultdict(list)

        def visit(expr):
            if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == "relax.call_tir":
                calls[expr.args[0]].append(expr)

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func.body, visit)
        plans = {}
        for gv, sites in calls.items():
            func = mod[gv]
            packed = pack_prim_func(func, target)
            if packed is None:
                continue
            new_func, param, index_map = packed
            if all(isinstance(c.args[1].fields[param], RelaxConstant) for c in sites):
                plans[gv] = (new_func, param, index_map)
        if not plans:
            return mod
        log.debug("pack_gemm_weights: %d kernels", len(plans))

        # (a new GlobalVar per packed kernel, of the same name: a GlobalVar's type is its function's signature)
        base = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in plans}, attrs=mod.attrs,
                            global_infos=mod.global_infos)

        @relax.expr_functor.mutator
        class Rewrite(relax.PyExprMutator):
            def visit_call_(self, call):
                call = super().visit_call_(call)
                if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.call_tir"):
                    return call
                plan = plans.get(call.args[0])
                if plan is None:
                    return call
                new_gv, param, index_map = plan
                args = list(call.args[1].fields)
                args[param] = self.builder_.emit(relax.op.layout_transform(args[param], index_map))
                return relax.Call(call.op, [new_gv, relax.Tuple(args), *call.args[2:]], call.attrs, call.ty_args)

        rewrite = Rewrite(base)
        for gv, (new_func, param, index_map) in list(plans.items()):
            plans[gv] = (rewrite.builder_.add_func(new_func, gv.name_hint), param, index_map)
        for gv, func in base.functions_items():
            if isinstance(func, relax.Function):
                rewrite.builder_.update_func(gv, rewrite.visit_expr(func))
        return rewrite.builder_.get()

    return run


def pack_prim_func(func, target):
    """(packed PrimFunc, index of the packed parameter among the call's
    arguments, the weight's IndexMap), or None where the pass does not
    apply (see the module's docstring)."""
    try:
        return _pack(func, target)
    except Exception as e:  # noqa: BLE001 - a kernel the pass cannot read or rewrite is left as it is
        log.debug("pack_gemm_weights: a kernel left as it is (%s)",
                  (str(e).strip().splitlines() or [type(e).__name__])[-1][:120])
        return None


def _pack(func, target):
    from ..tvm_compat import s_tir, target_codegen, tirx, tvm
    from . import cpu_default

    got = rule_kernel(func, target, "llvm")
    if got is None:
        return None
    sch, (main, _, consumers, n_s, extents) = got
    bits = target_codegen.llvm_get_vector_width(target)
    plan = cpu_default._plan(sch, main, n_s, extents, bits)
    if plan is None:
        return None
    v, width = plan[0], plan[1]
    block = sch.get(main.block_rv)
    if width < cpu_default.lanes(bits, block.writes[0].source.dtype.bits) or extents[v] % width \
            or extents[v] == width:
        return None
    vvar = main.iters[v].var
    reduction = {it.var for it in main.iters[n_s:]}
    params = list(func.params)

    def param_of(buf):
        return next((i for i, p in enumerate(params) if p.same_as(buf)), None)

    weight = None
    for r, read in enumerate(block.reads):
        idx = point_indices(read)
        if param_of(read.source) is None or len(idx) != 2 or any(e is None for e in idx):
            continue
        if sum(1 for e in idx if isinstance(e, tirx.Var) and e.same_as(vvar)) != 1:
            continue
        other = idx[1] if idx[0].same_as(vvar) else idx[0]
        if isinstance(other, tirx.Var) and any(other.same_as(k) for k in reduction):
            if weight is not None:
                return None  # two candidate operands: not a plain matmul
            weight = (r, read.source, 0 if idx[0].same_as(vvar) else 1)
    if weight is None:
        return None
    read_index, buffer, n_pos = weight
    if static_int(buffer.shape[n_pos]) != extents[v]:
        return None
    out_idx = point_indices(block.writes[0])
    product_axis = next((i for i, e in enumerate(out_idx) if isinstance(e, tirx.Var) and e.same_as(vvar)), None)
    if product_axis is None:
        return None
    w = width
    sch.transform_block_layout(main.block_rv, _split(v, len(extents), w, str(vvar.ty)))
    weight_map = tirx.IndexMap.from_func(
        (lambda k, n: (n // w, k, n % w)) if n_pos == 1 else (lambda n, k: (n // w, k, n % w)),
        index_dtype=str(buffer.shape[0].ty.dtype))
    sch.transform_layout(main.block_rv, ("read", read_index), weight_map)
    if not _split_chain(sch, main, consumers, extents[:n_s], v, w, product_axis, param_of):
        sch.reindex(main.block_rv, ("write", 0))  # the product over the block's own axes, then copied out
    new = s_tir.transform.StmtSimplify()(tvm.IRModule({"main": sch.mod["main"]}))["main"]
    if cpu_default.ContractionTiling().apply(new, target) is None:
        return None
    return new.with_attr(ATTR, w), param_of(buffer), weight_map


def _split_chain(sch, main, consumers, spatial: list[int], v: int, w: int, product_axis: int, param_of) -> bool:
    """The product and the elementwise blocks after it (bias, activation) laid
    out over [.., N / w, w, ..] as the main block now iterates, so that the
    default schedule applies them as each tile is written back; the last
    block still writes the kernel's output [.., N, ..]. `product_axis`: N's
    place among the product's indices. False (nothing changed) where a block
    after the product is not elementwise over its shape (a broadcast, a
    reduction of it) or the product is the output. Unit axes (a batch of
    one) are not iterated, and are left out of the comparisons."""

    product = sch.get(main.block_rv).writes[0].source
    if param_of(product) is not None or not consumers:
        return False
    solid = [e for e in spatial if e != 1]
    n_solid = sum(1 for e in spatial[:v] if e != 1)  # N's place among the axes of more than one element
    plans = []
    for i, c in enumerate(consumers):
        block = sch.get(c.block_rv)
        extents = [static_int(iv.dom.extent) for iv in block.iter_vars]
        if [e for e in extents if e != 1] != solid or len(block.writes) != 1:
            return False
        n_iter = [j for j, e in enumerate(extents) if e != 1][n_solid]
        index = _written_axis(block, block.iter_vars[n_iter].var)
        if index is None or (i < len(consumers) - 1 and param_of(block.writes[0].source) is not None):
            return False
        plans.append((c, n_iter, len(extents), index, len(block.writes[0].source.shape)))
    dtype = str(sch.get(main.block_rv).iter_vars[0].var.ty)
    sch.transform_layout(main.block_rv, ("write", 0), _split(product_axis, len(product.shape), w, dtype))
    for i, (c, n_iter, n_iters, index, ndim) in enumerate(plans):
        sch.transform_block_layout(c.block_rv, _split(n_iter, n_iters, w, dtype))
        if i < len(plans) - 1:
            sch.transform_layout(c.block_rv, ("write", 0), _split(index, ndim, w, dtype))
    return True


def _split(at: int, ndim: int, w: int, dtype: str):
    """The IndexMap of `ndim` axes that splits axis `at` into [at // w, at % w]."""
    from ..tvm_compat import tirx

    return tirx.IndexMap.from_func(lambda *ax: (*ax[:at], ax[at] // w, ax[at] % w, *ax[at + 1:]), ndim=ndim,
                                   index_dtype=dtype)


def _written_axis(block, var) -> int | None:
    """Where `var` indexes the block's output, if the block writes it at
    exactly its own axes in order (a unit axis of the buffer at 0); else None."""
    from ..tvm_compat import tirx

    idx = point_indices(block.writes[0])
    own = [iv.var for iv in block.iter_vars]
    order = []  # the block's axes in the order the output's indices name them
    for e in idx:
        j = next((j for j, o in enumerate(own) if isinstance(e, tirx.Var) and e.same_as(o)), None)
        if j is not None:
            order.append(j)
        elif static_int(e) != 0:
            return None
    solid = [j for j, iv in enumerate(block.iter_vars) if static_int(iv.dom.extent) != 1]
    if order != sorted(order) or not set(solid) <= set(order):
        return None
    return next((j for j, e in enumerate(idx) if isinstance(e, tirx.Var) and e.same_as(var)), None)
