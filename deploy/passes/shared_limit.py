"""Workaround: TVM 0.27's CUDA runtime lifts a kernel's shared-memory limit by its dynamic part alone.

Upstream symptom (TVM 0.27, H200; BERT at batch 32, sequence 128, with
`--fused-attention`): `validate failed: CUDALaunch Error:
CUDA_ERROR_INVALID_VALUE`, on every launch of one kernel.

A CUDA kernel gets 48 KB of shared memory a block, static and dynamic
together, unless its `MAX_DYNAMIC_SHARED_SIZE_BYTES` attribute is raised.
TVM's runtime (`CUDAWrappedFunc`, src/runtime/cuda/cuda_module.cc) raises
it only when the launch's dynamic size is 48 KB or more. A kernel with
static shared memory beside a dynamic part under 48 KB, the two together
above it, is never allowed what it asks for. The fused attention kernel
is one: its probabilities are static (attention_schedule.py says why),
17.5 KB at 128 keys, beside 32 KB of dynamic scores.

The fix: such a kernel declares 48 KB of dynamic shared memory
(`tirx.dyn_smem_bytes`, which TVM's SplitHostDevice takes over the
allocation's size), so the runtime raises the limit. It uses what it used;
the block reserves up to 16 KB more. Only kernels of our TIR pipeline's
tensor-core group whose lowered sizes show the case are re-lowered so
(passes/tensor_core_smem.py), any other kernel is untouched.
`tests/passes/test_shared_limit.py::test_gpu_tvm_launch_fails_without_the_declaration`
fails once TVM's runtime counts the static part.
"""

from __future__ import annotations

import re

DEFAULT_LIMIT = 48 * 1024  # CUDA's shared memory a block without the opt-in attribute
DECLARATION = "tirx.dyn_smem_bytes"

# (TVMScript of a lowered module: a host function's launch, a device function's static shared memory)
_LAUNCH = re.compile(r'T\.call_ffi_kernel\("(\w+)",.*?(?:T\.int64\((\d+)\)|(\d+)), launch_params=\[[^\]]*'
                     r'"tirx\.use_dyn_shared_memory"\]')
_STATIC = re.compile(r'T\.alloc_shared\(\(([\d, ]+)\)(?:, "(\w+)")?')


def static_bytes(device_script: str) -> int:
    """Bytes of static shared memory a lowered device function allocates."""
    from .kernel_shape import dtype_bytes

    total = 0
    for shape, dtype in _STATIC.findall(device_script):
        n = 1
        for d in shape.replace(" ", "").strip(",").split(","):
            n *= int(d)
        total += n * dtype_bytes(dtype or "float32")
    return total


def short_of_limit(lowered) -> dict[str, int]:
    """The functions of `lowered` (a module our pipeline lowered: host and
    device functions) that launch a kernel the runtime would refuse: static
    and dynamic shared memory above DEFAULT_LIMIT, the dynamic part under
    it. By host function name: the kernel's dynamic bytes."""
    from ..tvm_compat import tirx

    funcs = {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc)}
    short = {}
    for name, f in funcs.items():
        if f.attrs and "calling_conv" in f.attrs and int(f.attrs["calling_conv"]) == 2:
            continue  # (a device function: read below, where a launch under the limit names it)
        for kernel, big, small in _LAUNCH.findall(f.script(show_meta=False)):
            dynamic = int(big or small)
            if dynamic < DEFAULT_LIMIT and kernel in funcs and \
                    dynamic + static_bytes(funcs[kernel].script(show_meta=False)) > DEFAULT_LIMIT:
                short[name] = dynamic
    return short


def declare(func, nbytes: int = DEFAULT_LIMIT):
    """`func` (a scheduled PrimFunc whose root block holds one loop bound to
    blockIdx: one kernel) declaring `nbytes` of dynamic shared memory inside
    that loop; None for any other shape."""
    from ..tvm_compat import s_tir_stmt, tirx

    realize = func.body
    block = getattr(realize, "block", None)
    loop = getattr(block, "body", None)
    binding = getattr(loop, "thread_binding", None)
    if binding is None or not str(binding.thread_tag).startswith("blockIdx"):
        return None
    body = tirx.stmt.AttrStmt(tirx.const(0, "int32"), DECLARATION, tirx.const(nbytes, "int64"), loop.body)
    loop = tirx.stmt.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding,
                         loop.annotations, loop.step)
    block = s_tir_stmt.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, loop, block.init,
                              block.alloc_buffers, block.match_buffers, block.annotations)
    return func.with_body(s_tir_stmt.SBlockRealize(realize.iter_values, realize.predicate, block))
