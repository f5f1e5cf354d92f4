"""Every import path of Apache TVM used by the project, in one place.

TVM 0.27 moved MetaSchedule and DLight under `tvm.s_tir`, TIR to `tvm.tirx`,
and `tvm.nd.array` to `tvm.runtime.tensor`. When the next release moves them
again, this file is the one edit.

TVM is imported after `cpu_threads.configure()` (see deploy/passes/cpu_threads.py),
hence the imports below the top of the file.
"""
# ruff: noqa: E402

from __future__ import annotations

import contextlib as _contextlib
import inspect as _inspect
import sys as _sys
import threading as _threading

from .passes import cpu_threads

# Before TVM starts its CPU thread pool: all the physical cores, not half.
cpu_threads.configure()

import tvm  # noqa: F401  (re-exported)
from tvm import (
    relax,  # noqa: F401
    s_tir,  # noqa: F401  (s_tir.Schedule)
    sym,  # noqa: F401  (integer arithmetic: detect_linear_equation, Analyzer; `tvm.arith` before 0.27)
    te,  # noqa: F401
    tirx,  # noqa: F401
    topi,  # noqa: F401
)
from tvm.relax.frontend.onnx import (
    from_onnx,  # noqa: F401
    onnx_frontend,  # noqa: F401  (its op table: what the importer supports)
)
from tvm.s_tir import dlight  # noqa: F401
from tvm.s_tir import meta_schedule as ms  # noqa: F401
from tvm.target import Target  # noqa: F401
from tvm.target import codegen as target_codegen  # noqa: F401

tensor = tvm.runtime.tensor


def tensor_view(t, shape, byte_offset: int):
    """A view of `t` with `shape`, starting `byte_offset` bytes into it (no
    copy): `Tensor._create_view`, which TVM documents as low-level and liable
    to move."""
    return t._create_view(shape, relative_byte_offset=byte_offset)


def host_device(dev):
    """Where a run's host-side buffers live for device `dev`: page-locked
    host memory (`cuda_host`, cudaMallocHost) for a CUDA GPU, so that copies
    to and from it run asynchronously at full speed; plain host memory for
    the CPU."""
    kinds = tvm_ffi.DLDeviceType
    if dev.dlpack_device_type() == kinds.kDLCUDA:
        return tvm_ffi.Device(int(kinds.kDLCUDAHost), dev.index)
    return tvm.cpu(0)


def empty(shape, dtype: str, dev):
    return tvm.runtime.empty(shape, dtype, dev)


from_dlpack = tvm.runtime.from_dlpack
VirtualMachine = relax.VirtualMachine
load_module = tvm.runtime.load_module
save_json = tvm.ir.save_json
load_json = tvm.ir.load_json
import tvm_ffi  # noqa: E402

structural_hash = tvm_ffi.structural_hash
PassContext = tvm.transform.PassContext
Sequential = tvm.transform.Sequential


def versions() -> dict[str, str]:
    """Versions of TVM and its FFI, recorded in every manifest."""
    import importlib.metadata as md

    out = {"tvm": tvm.__version__}
    try:
        out["tvm_ffi"] = md.version("apache-tvm-ffi")
    except md.PackageNotFoundError:
        out["tvm_ffi"] = "unknown"
    return out


from tvm.ir.utils import derived_object  # noqa: E402,F401  (Python subclasses of MetaSchedule objects)
from tvm.runtime.vm import VMInstrumentReturnKind  # noqa: E402,F401
from tvm.s_tir.analysis import estimate_tir_flops  # noqa: E402,F401

# MetaSchedule's build-worker entry (build + export one candidate) and TVM's process pool.
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func as ms_builder_worker  # noqa: E402,F401
from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # noqa: E402,F401
from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker, StatusKind  # noqa: E402,F401


def register_tensor_intrinsics() -> None:
    """Register TVM's tensor intrinsics (wmma, mma, ...) and our TF32 ones
    (passes/tf32.py), once per process, only where needed: their module
    parses ~250 TVMScript functions.

    Workaround (TVM 0.27): TVMScript's `prim_func` calls `inspect.stack()`
    for every function it parses, and `inspect` finds each frame's source
    line through `getmodule()`, a scan of `sys.modules` per frame: the import
    took 20 s on the CPU machine (2026-12-04, with 1.2 s of it parsing) and
    20 to 70 s per process elsewhere, paid again in every build process of
    the kernel check and the build stage. While importing, `inspect.stack`
    and `inspect.getouterframes` take each frame's line from `linecache`
    instead (what they return otherwise, for one line of context, but for
    `positions`, None). tests/test_tvm_compat.py checks that the intrinsics
    come out the same, and fails once TVMScript no longer calls
    `inspect.stack()`. Under a lock: a second thread waits for the first's
    import (the module is in sys.modules as soon as it starts)."""
    global _intrinsics_registered
    with _INTRINSICS_LOCK:
        if _intrinsics_registered:
            return
        with _frames_from_linecache():
            import tvm.s_tir.tensor_intrin  # noqa: F401

            from .passes import tf32  # (our TF32 intrinsics, with TVM's)

            tf32.register_intrinsics()
        _intrinsics_registered = True


_INTRINSICS_LOCK = _threading.Lock()
_intrinsics_registered = False
_INSPECT_STACK, _INSPECT_OUTER = _inspect.stack, _inspect.getouterframes  # (the originals, saved once)


def _frame_infos(frame) -> list:
    """inspect.getouterframes(frame) with one line of context, each line read
    from linecache (see register_tensor_intrinsics)."""
    import linecache

    out = []
    while frame is not None:
        code, lineno = frame.f_code, frame.f_lineno
        line = linecache.getline(code.co_filename, lineno, frame.f_globals)
        out.append(_inspect.FrameInfo(frame, code.co_filename, lineno, code.co_name,
                                      [line] if line else None, 0 if line else None))
        frame = frame.f_back
    return out


def _fast_stack(context=1):
    return _frame_infos(_sys._getframe(1)) if context == 1 else _INSPECT_STACK(context)


def _fast_outer(frame, context=1):
    return _frame_infos(frame) if context == 1 else _INSPECT_OUTER(frame, context)


@_contextlib.contextmanager
def _frames_from_linecache():
    """inspect.stack()/getouterframes() reading frames from linecache while
    the context lasts (see register_tensor_intrinsics)."""
    _inspect.stack, _inspect.getouterframes = _fast_stack, _fast_outer
    try:
        yield
    finally:
        _inspect.stack, _inspect.getouterframes = _INSPECT_STACK, _INSPECT_OUTER


# TVM's TIR lowering pipeline (what tvm.compile/tvm.tirx.build run on each
# PrimFunc) and its registry of named pipelines: deploy.passes wraps it.
# A Relax constant (0.27 moved it from relax.Constant to the IR's own expressions).
from tvm.ir.expr import Constant as RelaxConstant  # noqa: E402,F401
from tvm.s_tir import stmt as s_tir_stmt  # noqa: E402,F401  (SBlock, SBlockRealize: a scheduled function rebuilt)
from tvm.s_tir.pipeline import default_s_tir_pipeline as default_tir_pipeline  # noqa: E402,F401
from tvm.tirx.compilation_pipeline import (
    register_tir_pipeline,  # noqa: E402,F401
    tirx_pipeline,  # noqa: E402,F401 - TIRx's (passes/wgmma_gemm.py)
)
