"""Running a scheduled PrimFunc's CUDA in tests/cuda_emu.py: its launch as
our TIR pipeline lowers it, and its output against TVM's plain lowering of
the unscheduled kernel for the CPU. The tests of our CUDA schedules use it
to check on the CPU machine what their `-m gpu` tests check on a GPU."""

from __future__ import annotations

import re

import numpy as np

from deploy.passes import tensor_core_smem
from deploy.tvm_compat import tvm

from . import cuda_emu

_C_TYPES = {"float16": "half", "float32": "float"}


def launch(func, target) -> tuple[int | tuple[int, int], tuple[int, int], int]:
    """A scheduled kernel's grid (its blocks along x, or (x, y) where it has
    blocks along y too), block and dynamic shared bytes, as our TIR pipeline
    lowers its launch."""
    func = func.with_attr("global_symbol", "k").with_attr("target", target)
    with target, tvm.transform.PassContext(opt_level=3):
        lowered = tensor_core_smem._pipeline_factory()[0](tvm.IRModule({"k": func}))
    text = "".join(f.script(show_meta=False) for f in lowered.functions.values())
    found = re.search(r"call_ffi_kernel\(\"k_kernel\", (.*?), launch_params=\[([^\]]*)\]", text)
    names = re.findall(r'"([^"]+)"', found.group(2))
    # the launch values are the call's last arguments, one a name: 32, T.int64(61440), ...
    values = [int(re.fullmatch(r"(?:T\.int64\()?(\d+)\)?", v.strip()).group(1))
              for v in found.group(1).split(",")[-len(names):]]
    got = dict(zip(names, values))  # (a name left out: 1; no dynamic shared memory: 0)
    grid = got.get("blockIdx.x", 1) if "blockIdx.y" not in got else (got.get("blockIdx.x", 1), got["blockIdx.y"])
    return (grid, (got.get("threadIdx.x", 1), got.get("threadIdx.y", 1)),
            got.get("tirx.use_dyn_shared_memory", 0))


def source(scheduled, target) -> str:
    """The scheduled kernel's CUDA, built as the package builds it (its
    kernel named `main_kernel`)."""
    from deploy.tuning import builder

    mod = tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")})
    return builder.lean_build(mod, target, None).imports[0].inspect_source()


def reference(func, seed: int = 0, scale: float = 0.25) -> list[np.ndarray]:
    """Seeded arguments of `func` (standard normal x `scale`), its output
    (the last) as TVM's plain lowering of it for the CPU writes it."""
    from deploy.tvm_compat import ms

    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal([int(d) for d in a.shape]) * scale).astype(str(a.dtype))
              for a in ms.arg_info.ArgInfo.from_prim_func(func)]
    cpu = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    cpu["main"](*tensors)
    return [t.numpy() for t in tensors]


# Problems the emulation reports of TVM's own code that are not a defect: TVM's cross-thread reduction
# (allreduce) shuffles the registers of the threads past the first warp's sums too, whose values it then
# discards, one uninitialized read of its `red_buf0`.
BENIGN = frozenset({"UNINIT local read red_buf0_ptr_1"})


def real_problems(problems: set) -> set:
    """`problems` (as `run` returns them, each `what@where`) less the BENIGN ones."""
    return {p for p in problems if p.split("@")[0] not in BENIGN}


def run(func, scheduled, target, args: list[np.ndarray], src: str | None = None) -> tuple[np.ndarray, set]:
    """`scheduled` (a schedule of `func`) run in emulation on `args` (its
    output, the last, is ignored: every element must be written once);
    returns (its output, the problems the emulation found). `src`: its CUDA
    as given (a mutation), else built here."""
    src = src if src is not None else source(scheduled, target)
    names = [b.name for b in func.params]  # (a PrimFunc's params are its buffers)
    tensors = {n: np.ascontiguousarray(a).view(np.uint8).ravel().copy() for n, a in zip(names, args)}
    tensors[names[-1]][:] = 0xFF
    params = {n + "_ptr": (n, _C_TYPES[str(b.dtype)]) for n, b in zip(names, func.params)}
    grid, block, dyn = launch(scheduled, target)
    problems, written = cuda_emu.run(src, "main_kernel", grid, block, dyn, tensors, params)
    assert (written[names[-1]] == 1).all(), "every output element written once"
    return tensors[names[-1]].view(args[-1].dtype).reshape(args[-1].shape), problems
