"""Stage 5, build: apply the tuning database, schedule what is left (DLight on
CUDA, TVM's default schedules on CPU), compile with CUDA graphs on CUDA, and
export one `.so` per batch bucket into a package folder whose manifest says
exactly what it holds."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from . import artifacts
from .config import Profile
from .export import ExportArtifact
from .optimize import OptimizeArtifact
from .targets import TargetInfo

log = logging.getLogger(__name__)
STAGE = "package"


@dataclasses.dataclass(frozen=True)
class PackageArtifact:
    folder: Path
    manifest: dict


def signature(func) -> tuple[list[dict], list[dict]]:
    """Shapes and dtypes of a Relax function's parameters and results."""

    def tensors(ty) -> list[dict]:
        if hasattr(ty, "fields"):
            return [t for f in ty.fields for t in tensors(f)]
        return [{"shape": [int(d) for d in ty.shape.values], "dtype": str(ty.dtype)}]

    params = [t for p in func.params for t in tensors(p.ty)]
    return params, tensors(func.ret_ty)


def compile_module(mod, target: TargetInfo, profile: Profile):
    """Relax module (optimized, fused, tuning records applied) -> tvm Executable."""
    from .tvm_compat import PassContext, dlight, dlight_gpu_rules, tvm

    tvm_target = target.tvm_target()
    config = {}
    if target.kind == "cuda" and profile.cuda_graph:
        config["relax.backend.use_cuda_graph"] = True
    with tvm_target, PassContext(opt_level=3, config=config):
        if target.kind == "cuda":
            mod = dlight.ApplyDefaultSchedule(*dlight_gpu_rules())(mod)
        return tvm.compile(mod, target=tvm_target)


def count_scheduled(mod) -> tuple[int, int]:
    from .tvm_compat import tirx

    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    tuned = sum(1 for f in funcs if f.attrs and f.attrs.get("tirx.is_scheduled", False))
    return tuned, len(funcs)


def run(
    profile: Profile,
    target: TargetInfo,
    exported: ExportArtifact,
    opt: OptimizeArtifact,
    databases: dict[int, Path],
    db_keys: dict[int, dict],
    folder: Path,
    model: str,
) -> PackageArtifact:
    """`databases` maps buckets to tuning databases (a bucket without one is
    built from default schedules)."""
    from .tune import database_digest, open_database
    from .tvm_compat import relax

    buckets = {}
    outputs_sig = None
    with artifacts.staged_dir(folder) as tmp:
        for bucket in profile.buckets:
            mod = opt.load_module(bucket)
            params_sig, outs = signature(mod["main"])
            outputs_sig = outs
            db, db_info = None, None
            if bucket in databases:
                db = open_database(databases[bucket], db_keys[bucket], create=False)
                if db is not None:
                    db_info = {"path": str(databases[bucket]), "digest": database_digest(databases[bucket])}
            with target.tvm_target():
                applied = mod
                if db is not None:
                    with db:
                        applied = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
                n_tuned, n_funcs = count_scheduled(applied)
            t0 = time.time()
            ex = compile_module(applied, target, profile)
            name = f"b{bucket}.so"
            ex.export_library(str(tmp / name))
            seconds = time.time() - t0
            log.info("build: bucket %d: %d of %d kernels tuned, compiled in %.1f s", bucket, n_tuned, n_funcs, seconds)
            buckets[str(bucket)] = {
                "file": name,
                "sha256": artifacts.sha256_file(tmp / name),
                "kernels": n_funcs,
                "tuned_kernels": n_tuned,
                "database": db_info,
                "compile_seconds": round(seconds, 1),
                "input_shapes": [p["shape"] for p in params_sig],
            }
        manifest = {
            "model": model,
            "inputs": [
                {"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in exported.inputs
            ],
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
            "buckets": buckets,
            "validation": None,
        }
        artifacts.write_manifest(tmp, STAGE, manifest, files=[b["file"] for b in buckets.values()])
    return load(folder)


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
