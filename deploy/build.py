"""Stage 5, build: apply the tuning database, schedule what is left (DLight on
CUDA, TVM's default schedules on CPU), compile with CUDA graphs on CUDA, and
export one `.so` per batch bucket into a package folder whose manifest says
exactly what it holds."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import numpy as np

from . import artifacts
from .config import Profile
from .errors import BuildError, run_in_processes
from .export import ExportArtifact
from .optimize import OptimizeArtifact
from .targets import TargetInfo

log = logging.getLogger(__name__)
STAGE = "package"


@dataclasses.dataclass(frozen=True)
class PackageArtifact:
    folder: Path
    manifest: dict


def tensor_types(ty) -> list[dict]:
    """Shapes and dtypes of a Relax tensor type, or of each tensor in a tuple type."""
    if hasattr(ty, "fields"):
        return [t for f in ty.fields for t in tensor_types(f)]
    return [{"shape": [int(d) for d in ty.shape.values], "dtype": str(ty.dtype)}]


def signature(func) -> tuple[list[dict], list[dict]]:
    """Shapes and dtypes of a Relax function's parameters and results."""
    params = [t for p in func.params for t in tensor_types(p.ty)]
    return params, tensor_types(func.ret_ty)


def compile_module(mod, target: TargetInfo, profile: Profile):
    """Relax module (optimized, fused, every kernel scheduled) -> tvm Executable,
    through our TIR pipeline (`deploy.passes.tensor_core_smem`)."""
    from .passes import tensor_core_smem, wgmma_gemm
    from .tvm_compat import PassContext, tvm

    tvm_target = wgmma_gemm.compile_target(target.tvm_target(), mod)
    config = {}
    if target.kind == "cuda" and profile.cuda_graph:
        config["relax.backend.use_cuda_graph"] = True
    with tvm_target, PassContext(opt_level=3, config=config):
        return tvm.compile(mod, target=tvm_target, tir_pipeline=tensor_core_smem.register())


def memory_plan(mod) -> dict:
    """What a bucket's module holds on its device: the weights (the module's
    constants, one copy per bucket's module) and the workspace TVM's static
    memory planning allocates for a run of `main` (the sum of its storage
    blocks: intermediate tensors share them, outputs and inputs excluded).
    Computed with the relax passes that lower `main` to explicit storage
    (`StaticPlanBlockMemory` among them), on a copy of the module."""
    from .tvm_compat import RelaxConstant, relax, tvm

    constants = {}

    def visit(expr):
        data = getattr(expr, "value", None) if isinstance(expr, RelaxConstant) else None  # (IntImm is one too)
        if data is not None and hasattr(data, "shape"):  # a constant used twice is stored once
            dtype = tvm.DataType(str(data.dtype))
            constants[expr] = int(np.prod([int(d) for d in data.shape])) * ((dtype.bits * dtype.lanes + 7) // 8)

    relax.analysis.post_order_visit(mod["main"], visit)
    weights = sum(constants.values())
    lowered = tvm.transform.Sequential([
        relax.transform.RewriteDataflowReshape(), relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(), relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
    ])(mod)
    storage = tvm.ir.Op.get("relax.memory.alloc_storage")
    workspace = 0

    def storages(expr):
        nonlocal workspace
        if isinstance(expr, relax.Call) and expr.op.same_as(storage) and isinstance(expr.args[0], relax.ShapeExpr):
            workspace += int(expr.args[0].values[0])

    relax.analysis.post_order_visit(lowered["main"], storages)
    return {"weights_bytes": weights, "workspace_bytes": workspace}


def _memory_or_none(mod) -> dict | None:
    """memory_plan, or None (said in the log) where it cannot tell: a
    record of the package, never a reason to fail its build."""
    try:
        return memory_plan(mod)
    except Exception as e:  # noqa: BLE001
        log.warning("build: device memory of the bucket not recorded (%s)", str(e).strip().splitlines()[-1][:200])
        return None


def build_kernel(name: str, func, target: TargetInfo):
    """Build one PrimFunc alone (raises when it does not build): how the
    schedule chain finds the kernels at fault when a module fails."""
    from .passes import tensor_core_smem, wgmma_gemm
    from .tvm_compat import PassContext, tvm

    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    tvm_target = wgmma_gemm.compile_target(target.tvm_target(), mod)
    with tvm_target, PassContext(opt_level=3):
        return tvm.tirx.build(mod, target=tvm_target, pipeline=tensor_core_smem.register())


def _build_bucket(job) -> tuple[dict, list[dict]]:
    """Process-pool entry: `job` is build_bucket's arguments in order."""
    return build_bucket(*job)


def build_bucket(module_path: str, target: TargetInfo, profile: Profile, db: tuple[str, dict] | None, out: str,
                 store_root: str | None = None):
    """Compile one bucket's optimized module (tuning records from `db`, a
    (folder, key) pair, when given, and from the kernel store under
    `store_root` for kernels other models tuned) into the .so at `out`;
    returns the manifest entry and the output signature."""
    from .passes import schedule
    from .tuning import database as dbs
    from .tuning import store as kernel_store
    from .tvm_compat import load_json, relax

    mod = load_json(Path(module_path).read_text())
    params_sig, outs = signature(mod["main"])
    db_info, store_info, tuned_mod = None, None, None
    tvm_target = target.tvm_target()
    with tvm_target:
        store_lines, hashes = None, None
        store_digest = None if store_root is None else kernel_store.digest(Path(store_root), target)
        if store_digest is not None:
            hashes = kernel_store.module_hashes(mod, tvm_target)
            store_lines = kernel_store.lines_for(Path(store_root), target, hashes)
            store_info = {"path": str(kernel_store.folder(Path(store_root), target)), "digest": store_digest,
                          "kernels": len(store_lines[1])}
        if db is not None or store_lines:
            folder, key = (Path(db[0]), db[1]) if db is not None else (None, None)
            own_kernels: set[str] = set()
            store_kernels: set[str] = set()
            with dbs.open_readonly(folder, key, store_lines, own_kernels, store_kernels) as database:
                if store_info is not None:
                    store_info["not_in_database"] = len(store_kernels - own_kernels)
                if database is not None:
                    if db is not None:
                        db_info = {"path": db[0], "digest": dbs.digest(Path(db[0]))}
                        if own_kernels:  # how much of it this module's kernels use (stale_database)
                            hashes = kernel_store.module_hashes(mod, tvm_target) if hashes is None else hashes
                            db_info.update(database_coverage(hashes, own_kernels))
                    with database:
                        tuned_mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        t0 = time.time()
        try:
            compiled, kernels = schedule.build(
                mod, tuned_mod, tvm_target, target.kind,
                compile_fn=lambda m: compile_module(m, target, profile),
                kernel_builds=lambda name, f: build_kernel(name, f, target),
                wgmma=profile.uses_wgmma_gemm, wgmma_gather=profile.uses_wgmma_gemm,
            )
        except schedule.UnbuildableKernelError as e:
            raise BuildError(f"build: {e}") from e
    compiled.export_library(out)
    report = schedule.summarize(kernels)
    n_tuned = report["sources"].get(schedule.TUNED, 0)
    n_funcs = len(kernels)
    info = {
        "file": Path(out).name,
        "sha256": artifacts.sha256_file(out),
        "kernels": n_funcs,
        "tuned_kernels": n_tuned,
        "database": db_info,
        # The kernel store (other models' records for the same kernels): how many of this module's kernels it holds.
        "store": store_info,
        # Where each kernel's schedule came from, and every fallback with its reason.
        "schedules": report["sources"],
        "fallbacks": report["fallbacks"],
        # Kernels a DLight rule declined by raising before another source took them (passes/schedule.py: summarize).
        "declined": report["declined"],
        "compile_seconds": round(time.time() - t0, 1),
        "input_shapes": [p["shape"] for p in params_sig],
        # Device memory of a run: weights and the planned workspace (the server checks the sum fits).
        "memory": _memory_or_none(mod),
    }
    return info, outs


def database_coverage(hashes: set[str], own: set[str]) -> dict:
    """How much of a database a module uses: of the module's kernel
    workloads (`hashes`), those with a record the build applies (`own`, as
    database.open_readonly gives them), and the records of kernels the
    module does not have."""
    return {"kernels_with_records": len(hashes & own), "records_of_other_kernels": len(own - hashes)}


def stale_database(info: dict) -> str | None:
    """A warning where a bucket's own database was tuned for other kernels
    than the module's (the model or the pipeline changed since): it has
    tuned records of fewer than half the module's kernels, and of more
    kernels that the module no longer has, at least a quarter as many as
    the module's (a database barely tuned, with a few records gone stale,
    is not worth a warning). None otherwise. (ConvNeXt-T b1, 2026-12-04: a
    database tuned when the model had 45 kernels had records of none of its
    25 kernels, and the package ran 2.9x slower than tuned.)"""
    db = info.get("database") or {}
    have, other = db.get("kernels_with_records"), db.get("records_of_other_kernels")
    if have is None or other is None or 2 * have >= info["kernels"] or other <= have or 4 * other < info["kernels"]:
        return None
    return (f"its database has tuned records of {have} of the module's {info['kernels']} kernels and of {other} "
            f"kernels it no longer has: tuned before the model or the pipeline changed; `make tune` with trials "
            f"tunes the new ones ({db['path']})")


def run(
    profile: Profile,
    target: TargetInfo,
    exported: ExportArtifact,
    opt: OptimizeArtifact,
    databases: dict,
    db_keys: dict,
    folder: Path,
    model: str,
    store_root: Path | None = None,
    only: set | None = None,
) -> PackageArtifact:
    """`databases` maps buckets (shapes.Bucket; the optimized module's
    buckets are built) to tuning databases (a bucket without one is
    built from default schedules); the kernel store under `store_root` (the
    databases' root) adds the records other models have for the same
    kernels. Buckets are compiled in parallel processes (each ResNet-50
    bucket takes about a minute of single-threaded compile). `only`: build
    just these buckets."""
    jobs = []
    with artifacts.staged_dir(folder) as tmp:
        order = [b for b in exported.buckets(profile) if only is None or b in only]
        for bucket in order:
            db = (str(databases[bucket]), db_keys[bucket]) if bucket in databases else None
            jobs.append((str(opt.module_path(bucket)), target, profile, db, str(tmp / f"b{bucket.label}.so"),
                         None if store_root is None else str(store_root)))
        workers = min(len(jobs), max(1, (os.cpu_count() or 1)))
        results = run_in_processes(_build_bucket, jobs, workers)
        buckets, outputs_sig = {}, None
        for bucket, (info, outs) in zip(order, results):
            outputs_sig = outs  # the last (largest) bucket's: a dimension's axis has its largest length
            buckets[bucket.label] = info
            stale = stale_database(info)
            if stale:
                log.warning("build: bucket %s: %s", bucket, stale)
            log.info(
                "build: bucket %s: %d of %d kernels tuned, compiled in %.1f s (schedules: %s%s)",
                bucket, info["tuned_kernels"], info["kernels"], info["compile_seconds"],
                ", ".join(f"{k} {v}" for k, v in info["schedules"].items()),
                f"; {len(info['fallbacks'])} fallback(s), listed in the manifest" if info["fallbacks"] else "",
            )
        manifest = {
            "model": model,
            "inputs": [_input_entry(i, exported.index_ranges) for i in exported.inputs],
            # (each integer input that indexes a table has its "range": runtime.Predictor checks it; a package
            # without this key predates the check)
            "input_ranges": True,
            "outputs": [
                {"name": n, "shape": o["shape"][1:], "dtype": o["dtype"]} for n, o in zip(exported.outputs, outputs_sig)
            ],
            "precision": profile.precision,
            "accumulate": profile.accumulate if profile.precision == "fp16" else "fp32",
            "layout": profile.layout,
            "cuda_graph": bool(target.kind == "cuda" and profile.cuda_graph),
            "target": target.key(),
            "gpu": gpu_info(target),
            # Without a CUDA driver at build time TVM embeds CUDA source, compiled when loaded.
            "cuda_code": None if target.kind != "cuda" else ("binary" if target.has_device else "source"),
            "onnx_sha256": artifacts.sha256_file(exported.onnx_path),
            "dims": [dataclasses.asdict(d) for d in exported.dims],
            "buckets": buckets,
            "validation": None,
        }
        artifacts.write_manifest(tmp, STAGE, manifest, files=[b["file"] for b in buckets.values()])
    return load(folder)


def _input_entry(spec, index_ranges: dict) -> dict:
    """An input in the package's manifest: name, per-sample shape, dtype and,
    for an integer input that indexes a table, the values it may take
    ("range": [lowest, one past the highest]; runtime.Predictor.check_inputs
    refuses others, passes/onnx_indices.py says why)."""
    entry = {"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype}
    if spec.name in index_ranges:
        entry["range"] = list(index_ranges[spec.name])
    return entry


def gpu_info(target: TargetInfo) -> dict | None:
    if target.kind != "cuda":
        return None
    info = {"name": target.device_name or None, "arch": target.arch, "compute_capability": None}
    if target.has_device:
        info["compute_capability"] = target.device().compute_version
    else:
        digits = target.arch.removeprefix("sm_").rstrip("a")
        info["compute_capability"] = f"{digits[:-1]}.{digits[-1]}"
    return info


def load(folder: Path, verify: bool = True) -> PackageArtifact:
    return PackageArtifact(Path(folder), artifacts.read_manifest(folder, STAGE, verify=verify))
