"""Workaround: TVM 0.27's StorageRewrite types a tensor-core accumulator wrongly.

Upstream symptom (TVM 0.27, CUDA, fp16 inputs with fp32 accumulation):
  `Check failed: source_buffer->dtype.WithLanes(1) == scalar_dtype (T.float16 vs.
  T.float32) : tvm_access_ptr element type must match the source buffer`
StorageRewrite reuses a dead fp16 shared-memory tile for the kernel's fp32
accumulator tile (its allocator ignores dtypes) and LowerIntrin then rejects the
`tvm_access_ptr`. It failed 53 to 62 of every 64 MetaSchedule candidates on the
H200. The build option `tirx.merge_static_smem` turns that reuse off (the later
shared-memory merge types the pointers correctly).

Scope: that option must not reach other kernels. Set for a whole module it
breaks DLight's reductions, softmax, LayerNorm and pooling kernels in
MergeSharedMemoryAllocations (`SharedMemoryRewriter::GetBufferOffset: Check
failed: (it != scope.buffer_byte_offsets.end())`), which failed 15 of 17
architectures. So this module registers a TIR pipeline, `PIPELINE`, that runs
TVM's own pipeline on the tensor-core kernels with the option on (the fused
attention kernels apart, see EVERY_WARP_BUFFER), on the SIMT kernels whose
software pipeline asks for cp.async (SIMT_ASYNC) with only ASYNC_COPY on, and on every
other function as TVM ships it. `tests/passes/test_passes.py` checks that both
upstream failures still happen, and fails once TVM no longer needs this.
"""

from __future__ import annotations

import logging

from .attention import ATTR as _ATTENTION_ATTR

_log = logging.getLogger(__name__)

PIPELINE = "deploy"  # the name to give tvm.compile(tir_pipeline=) / tvm.tirx.build(pipeline=)
OPTION = "tirx.merge_static_smem"
# Also set for a kernel that asks for it (a stage of its software pipeline
# marked asynchronous: our tensor-core GEMMs', and simt_gemm.py's with two
# stages, lowered apart from the tensor-core kernels, without OPTION): TVM
# then issues that stage's copies as `cp.async`. Off by default in TVM; without it the annotation is
# ignored and the copies are synchronous.
ASYNC_COPY = "tirx.use_async_copy"

# What a scheduled PrimFunc that uses tensor cores contains, in TVMScript: WMMA
# fragments and intrinsics (MetaSchedule's wmma rules, DLight's Matmul on
# sm_80+) and the mma.sync path (`m16n8k8` fragments, mma_store/mma_fill).
_TENSOR_CORE_MARKERS = ("wmma.", "tvm_mma_sync", "tvm_load_matrix_sync", "m16n8k", "mma_store", "mma_fill",
                        "ptx_mma", "ldmatrix")


# A scheduled kernel's block annotation (passes/mma_gemm.py): the blocks per
# SM to compile it for, `__launch_bounds__`' second argument. TVM reads it
# from a statement attribute that its schedules cannot write, so the
# pipeline sets it on the lowered kernel.
MIN_BLOCKS = "deploy.min_blocks_per_sm"
_MIN_BLOCKS_ATTR = "tirx.launch_bounds_min_blocks_per_sm"

_ASYNC_MARKER = "software_pipeline_async_stages"  # a kernel that asks for cp.async (mma_gemm.py's, simt_gemm.py's)
# A loop annotation of simt_gemm.py's pipelined kernels: they alone, of the kernels without tensor cores, are
# lowered with ASYNC_COPY. MetaSchedule's SIMT candidates also ask for async stages on sm_80+, and lowered with
# it their copies become `tirx.dma_start_group` calls the CUDA codegen cannot print (TVM ignores the request
# without it, as before; tests/tuning/test_cuda_tuning.py builds such a candidate).
SIMT_ASYNC = "deploy.simt_async_copy"
# Workaround: TVM 0.27's LowerWarpMemory rewrites only the first `warp`
# buffer among the statements of a kernel's body (WarpMemoryRewriter takes
# the rest of the sequence as that buffer's scope and stops). A kernel with
# two GEMMs (passes/attention.py's) then keeps its second accumulator as a
# local array of 32 x its size: 4 KB of stack a thread in ViT's attention.
# The fused attention kernels (their device functions marked with this
# attribute by the pipeline) get the pass again until no `warp` buffer is
# left; every other kernel is lowered as before.
# tests/passes/test_attention.py::test_tvm_lowers_only_the_first_warp_buffer
# fails once TVM lowers them all.
EVERY_WARP_BUFFER = "deploy.lower_every_warp_buffer"
_ATTENTION_MARKER = f'"{_ATTENTION_ATTR}"'  # (passes/attention.py's kernels, in their TVMScript)


def _has_tensor_cores(text: str) -> bool:
    return any(m in text for m in _TENSOR_CORE_MARKERS)


def uses_tensor_cores(func) -> bool:
    """Whether a PrimFunc computes on tensor cores (read from its TVMScript:
    TVM 0.27 exposes no TIR visitor to Python)."""
    return _has_tensor_cores(func.script(show_meta=False))


def has_fragments(mod) -> bool:
    """Whether a scheduled module keeps tensor-core fragments (WMMA's
    `wmma.*` or mma.sync's `m16n8k8.*`/`warp` buffers), read from its
    blocks' allocations: `uses_tensor_cores` for the search's hot path
    (mma_gemm.verify_postproc, on every draw), which printing each draw's
    TVMScript would slow."""
    from .mma_epilogue import _blocks

    for f in mod.functions.values():
        for b in _blocks(f.body) if hasattr(f, "body") else []:
            if any(buf.scope().startswith(("wmma.", "m16n8k8.")) or buf.scope() == "warp" for buf in b.alloc_buffers):
                return True
    return False


def tensor_core_context(async_copy: bool = False, no_cse: bool = False, merge: bool = True):
    """The current PassContext with `OPTION` set (unless not `merge`), and
    `ASYNC_COPY` where asked: how a tensor-core kernel is lowered (the
    pipeline below, and passes/mma_gemm.py's VerifyGPUCode). `no_cse`: without TIR's common
    subexpression elimination, which hides the warp index from
    LowerWarpMemory in an offset it names (EVERY_WARP_BUFFER's kernels)."""
    from ..tvm_compat import PassContext

    outer = PassContext.current()
    config = dict(outer.config)
    if merge:
        config[OPTION] = True
    if async_copy:
        config[ASYNC_COPY] = True
    if no_cse:
        config["tirx.disable_cse_tir"] = True
        # (and its unrolled loops left to nvcc, `#pragma unroll`: unrolled in
        # TIR, a fragment's offset is a constant plus the lane's, which
        # LowerWarpMemory's rewrite divides and the simplifier does not fold)
        config["tirx.UnrollLoop"] = {**dict(config.get("tirx.UnrollLoop", {})), "explicit_unroll": False}
    return PassContext(opt_level=outer.opt_level, config=config,
                       required_pass=list(outer.required_pass), disabled_pass=list(outer.disabled_pass))


def _pipeline_factory():
    from ..tvm_compat import default_tir_pipeline, tirx, tirx_pipeline, tvm
    from . import (
        mma_epilogue,  # (the other workaround its tensor-core kernels need, applied first)
        shared_limit,  # (and the runtime's shared-memory limit, after lowering)
        wgmma_gemm,
    )

    stock, finalize_host, finalize_device = default_tir_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="DeployTIRPipeline")
    def pipeline(mod, _ctx):
        # (passes/wgmma_gemm.py's kernels, written in TIRx: TVM's TIRx pipeline, which shares our finalization)
        tirx_funcs = {gv: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc) and wgmma_gemm.is_ours(f)}
        if tirx_funcs:
            wgmma_gemm.fix_noop_barrier_codegen()
            rest = pipeline(tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in tirx_funcs},
                                         attrs=mod.attrs, global_infos=mod.global_infos))
            rest.update(tirx_pipeline()[0](tvm.IRModule(tirx_funcs, attrs=mod.attrs, global_infos=mod.global_infos)))
            return rest
        texts = {gv: f.script(show_meta=False) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
        tc = {gv: mma_epilogue.apply_to_func(mod[gv]) for gv, text in texts.items() if _has_tensor_cores(text)}
        # (kernels whose software pipeline asks for cp.async without tensor cores, simt_gemm.py's: ASYNC_COPY only)
        simt = {gv: mod[gv] for gv, text in texts.items() if gv not in tc and SIMT_ASYNC in text}
        if not tc and not simt:
            return stock(mod)
        rest = {gv: f for gv, f in mod.functions.items() if gv not in tc and gv not in simt}
        attention = {gv: f for gv, f in tc.items() if _ATTENTION_MARKER in texts[gv]}
        lowered = []
        for group, no_cse, merge in (({gv: f for gv, f in tc.items() if gv not in attention}, False, True),
                                     (attention, True, True), (simt, False, False)):
            if not group:
                continue
            with tensor_core_context(async_copy=any(_ASYNC_MARKER in texts[gv] for gv in group), no_cse=no_cse,
                                     merge=merge):
                out = stock(tvm.IRModule(group, attrs=mod.attrs))
                # (kernels the runtime would refuse their shared memory: again, declaring 48 KB dynamic)
                short = shared_limit.short_of_limit(out)
                declared = {gv: shared_limit.declare(f) for gv, f in group.items() if gv.name_hint in short}
                for gv in (gv for gv, f in declared.items() if f is None):
                    _log.warning("kernel %s: its shared memory passes 48 KB with %d bytes of it dynamic, which TVM's "
                                 "runtime will not allow (docs/tvm-notes.md)", gv.name_hint, short[gv.name_hint])
                if any(f is not None for f in declared.values()):
                    group = {**group, **{gv: f for gv, f in declared.items() if f is not None}}
                    out = stock(tvm.IRModule(group, attrs=mod.attrs))
            lowered.append(_launch_bounds(out, {gv.name_hint: texts[gv] for gv in group}))
        for part in lowered:  # (the attention kernels' part: found by their names)
            _mark_device_functions(part, {gv.name_hint: 1 for gv in attention}, EVERY_WARP_BUFFER)
        out = stock(tvm.IRModule(rest, attrs=mod.attrs)) if rest else lowered.pop()
        for part in lowered:
            out.update(part)
        return out

    return pipeline, finalize_host, _finalize_device(finalize_device)


def _finalize_device(stock):
    """TVM's device finalization (`stock`, a function making the pass),
    LowerWarpMemory first run until no `warp` buffer is left on the device
    functions marked EVERY_WARP_BUFFER (see there)."""

    def make():
        from ..tvm_compat import tirx, tvm

        rest = stock()

        @tvm.transform.module_pass(opt_level=0, name="DeployFinalizeDevice")
        def run(mod, _ctx):
            marked = {gv: f for gv, f in mod.functions.items()
                      if isinstance(f, tirx.PrimFunc) and f.attrs and EVERY_WARP_BUFFER in f.attrs}
            if marked:
                sub = tvm.IRModule(marked, attrs=mod.attrs)
                for _ in range(64):  # (one buffer a run; a kernel has a handful)
                    if not any('scope="warp"' in f.script(show_meta=False) for f in sub.functions.values()):
                        break
                    sub = tirx.transform.LowerWarpMemory()(sub)
                mod = tvm.IRModule({**dict(mod.functions.items()), **dict(sub.functions.items())}, attrs=mod.attrs,
                                   global_infos=mod.global_infos)
            return rest(mod)

        return run

    return make


def _mark_device_functions(mod, wanted: dict, attr: str) -> None:
    """Set `attr` to `wanted[name]` on the device functions (TVM's
    `<name>_kernel`, `<name>_kernel_1`, ...) of the kernels named in
    `wanted`, in `mod` (the pipeline's own lowered module)."""
    import re

    from ..tvm_compat import tirx

    if not wanted:
        return
    for gv, f in list(mod.functions.items()):
        if not isinstance(f, tirx.PrimFunc) or not f.attrs or "calling_conv" not in f.attrs:
            continue
        for name, value in wanted.items():
            if re.fullmatch(re.escape(name) + r"_kernel(_\d+)?", gv.name_hint):  # (TVM's names for its kernels)
                mod[gv] = f.with_attr(attr, value)


def _launch_bounds(mod, texts: dict):
    """`mod` (the pipeline's own lowered module, updated in place) with
    MIN_BLOCKS of each kernel (read from its scheduled TVMScript, `texts` by
    function name) set on its device functions."""
    import re

    wanted = {}
    for name, text in texts.items():
        found = re.search(rf'"{re.escape(MIN_BLOCKS)}": (\d+)', text)
        if found:
            wanted[name] = int(found.group(1))
    _mark_device_functions(mod, wanted, _MIN_BLOCKS_ATTR)
    return mod


def register() -> str:
    """Register the pipeline under `PIPELINE` (idempotent); returns its name."""
    from ..tvm_compat import register_tir_pipeline

    register_tir_pipeline(PIPELINE, _pipeline_factory)
    return PIPELINE
