"""The candidate builder of the tune stage: MetaSchedule's LocalBuilder with our
build function (no tensor-intrinsic import, our TIR pipeline), one process pool
per run, NVRTC's precompiled headers in the workers, and the build-time stats.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from .rpc import ignore_sigint

log = logging.getLogger(__name__)


MMA_FRAGMENT_MARKERS = ("mma_store", "ldmatrix")  # (in a scheduled kernel's TVMScript)


def lean_build(mod, target, _params):
    """MetaSchedule's default build minus its `import tvm.s_tir.tensor_intrin`,
    which parses ~500 TVMScript functions (40-75 s) in every fresh worker pool
    and ran past the builder's time-out. Candidates arrive already tensorized,
    so the workers do not need the intrinsics registered, except where a
    kernel's `mma.sync` fragments are stored or loaded by `ldmatrix`: CUDA
    codegen then looks up the fragment layout the intrinsics' module
    registers (`tirx.index_map.shared_16x16_to_ldmatrix_32x8_layout`;
    without it every such candidate failed with `index_map_func.has_value()`).
    It builds through the same TIR pipeline as the final compile
    (deploy.passes.tensor_core_smem)."""
    from deploy.passes import tensor_core_smem
    from deploy.tvm_compat import RemoveWeightLayoutRewriteBlock, register_tensor_intrinsics, tvm

    if any(m in f.script(show_meta=False) for f in mod.functions.values() for m in MMA_FRAGMENT_MARKERS):
        register_tensor_intrinsics()
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target, pipeline=tensor_core_smem.register())


def usable_cpus() -> int:
    """CPUs this process may use: its affinity set, capped by a cgroup CPU
    quota. os.cpu_count() (and MetaSchedule's default worker count) can see
    every core of the host inside a container."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def so_export(mod) -> str:
    """Export a built candidate as a shared library, linked here in the
    parallel build workers. MetaSchedule's default exports a .tar, which the
    runner then links (g++) before loading: serial work on the runner's side
    for every candidate, while the GPU waits."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="tvm-deploy-cand-"), "candidate.so")
    mod.export_library(path)
    return path


def _timed_build(job) -> tuple[str, float]:
    """MetaSchedule's build worker, in a build process: the artifact's path
    and the seconds this candidate took to build and export."""
    from ..tvm_compat import ms_builder_worker

    t0 = time.perf_counter()
    path = ms_builder_worker(*job)
    return path, time.perf_counter() - t0


def empty_build_times(workers: int) -> dict:
    """An empty record of build times: per build call (a batch) and per
    candidate built; the candidates that did not build."""
    return {"batch_wall_s": [], "candidate_s": [], "failed": 0, "timed_out": 0, "workers": workers}


def build_stats(times: dict) -> dict:
    """Where a run's build time went, from a builder's `times` (or several
    lanes' merged): per candidate (in the workers) and per batch (what
    tuning waited for). `busy` is the workers' share of the batches' wall
    time spent building: low means a batch waited on a few slow candidates
    (or on starting workers), not on building in general. `candidate_s`
    holds the candidates that built; `failed` and `timed_out` count the
    others (a time-out held its worker for the builder's limit)."""
    import numpy as np

    walls, workers = times["batch_wall_s"], times["workers"]
    if not walls:
        return {}
    each = np.asarray(times["candidate_s"] or [0.0])
    wall = float(sum(walls))
    return {
        "batches": len(walls), "candidates": len(times["candidate_s"]), "failed": times["failed"],
        "timed_out": times["timed_out"], "workers": workers,
        "wall_s": round(wall, 1), "batch_p50_s": round(float(np.median(walls)), 2),
        "candidate_p50_s": round(float(np.median(each)), 2), "candidate_p90_s": round(float(np.percentile(each, 90)), 2),
        "candidate_max_s": round(float(each.max()), 2), "candidate_sum_s": round(float(each.sum()), 1),
        "busy": round(float(each.sum()) / (wall * workers), 3) if wall > 0 else None,
    }


# NVRTC options for the build workers: with the headers every TVM CUDA
# kernel includes pre-included, NVRTC's automatic precompiled header (-pch)
# holds them, so a worker parses them once instead of for every candidate
# (TVM's preamble puts code right after its first #include, which ends what
# -pch alone would precompile). On the CPU machine: 0.26-0.39 of the NVRTC time
# per ResNet-50 candidate (p50 1.31 -> 0.51 s fp16 b1, 2.33 -> 1.10 s b64,
# 1.65 -> 0.54 s fp32), the same SASS bytes in 48 of 48 candidates
# (results/cpu/2026-11-30/nvrtc-compile, scripts/nvrtc_profile.py).
NVRTC_PCH_OPTS = ("-pch -include cuda/std/cstdint -include cuda/std/limits -include cuda/std/type_traits "
                  "-include cuda_fp16.h")


NVRTC_PCH_MIN = (12, 8)  # older NVRTC may reject -pch: then every candidate would fail


def _build_worker_init() -> None:
    """In each build worker: SIGINT ignored (see `rpc.ignore_sigint`), and
    NVRTC_PCH_OPTS, with an NVRTC that takes it, unless the user set
    TVM_CUDA_NVRTC_EXTRA_OPTS (empty turns it off)."""
    ignore_sigint()
    if "TVM_CUDA_NVRTC_EXTRA_OPTS" in os.environ:
        return
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001  no NVRTC (a CPU target, or nvcc): nothing to set
        return
    if (major, minor) >= NVRTC_PCH_MIN:
        os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = NVRTC_PCH_OPTS


def sweep_nvrtc_pch(folder: str | None = None) -> int:
    """Remove NVRTC's precompiled-header folders (`__nvrtc_auto_pch_<pid>_*`
    in the temp folder, ~60 MB each) of processes that are gone: NVRTC
    removes its own only on a normal exit, and the build pool ends recycled
    and timed-out workers with SIGKILL. How many were removed."""
    import shutil
    import tempfile

    n = 0
    for d in Path(folder or tempfile.gettempdir()).glob("__nvrtc_auto_pch_*"):
        m = re.match(r"__nvrtc_auto_pch_(\d+)_", d.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:  # someone else's process
            continue
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
        n += 1
    return n


def _make_builder(max_workers: int, timeout_s: float, recycle_after: int = 64, journal=None):
    """MetaSchedule's LocalBuilder, but with one worker pool for the whole
    run. LocalBuilder starts a fresh pool for every batch, and each worker
    then imports TVM (which imports torch): seconds of every batch on 16
    workers. TVM restarts its pools because workers leak memory after many
    builds, so each worker here is replaced after `recycle_after` builds.
    Each batch's results go to `journal` (a `journal.Journal`), which pairs
    them with the candidates the search handed out."""
    from ..tvm_compat import PopenPoolExecutor, StatusKind, derived_object, ms

    @derived_object
    class PersistentBuilder(ms.builder.PyBuilder):
        def __init__(self):
            super().__init__()
            self.pool = None
            self.times = empty_build_times(max_workers)

        def build(self, build_inputs):
            t0 = time.perf_counter()
            if self.pool is None:
                self.pool = PopenPoolExecutor(
                    max_workers=max_workers, timeout=timeout_s, maximum_process_uses=recycle_after,
                    initializer=_build_worker_init,
                )
            jobs = [(lean_build, so_export, b.mod, b.target, None) for b in build_inputs]
            results = []
            for r in self.pool.map_with_error_catching(_timed_build, jobs):
                if r.status == StatusKind.COMPLETE:
                    path, seconds = r.value
                    self.times["candidate_s"].append(seconds)
                    results.append(ms.builder.BuilderResult(path, None))
                elif r.status == StatusKind.TIMEOUT:
                    self.times["timed_out"] += 1
                    results.append(ms.builder.BuilderResult(None, f"build timed out after {timeout_s:.0f} s"))
                else:
                    self.times["failed"] += 1
                    results.append(ms.builder.BuilderResult(None, "build failed\n" + str(r.value)))
            self.times["batch_wall_s"].append(time.perf_counter() - t0)
            sweep_nvrtc_pch()
            if journal is not None:
                journal.built(results)
            return results

        def close(self):
            if self.pool is not None:
                self.pool.shutdown()
                self.pool = None
            sweep_nvrtc_pch()

    return PersistentBuilder()
