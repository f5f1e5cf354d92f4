"""Per-kernel report for one bucket of a built model (TVM 0.27 removed
`vm.profile`, so kernels are timed here through the VM's instrument hook).

CUDA graphs hide individual kernels, so the bucket is rebuilt without them
(same optimized module, same tuning records) into `<workdir>/profile/`. Each
kernel call is timed with a device synchronization before and after it: the
sum is larger than the graph-replayed latency (launch gaps, sync cost), but
the shares show where the time goes. Throughput uses TVM's FLOP estimate of
each kernel and the bytes of its arguments (each read or written once), so
achieved GFLOP/s and GB/s can be set against the device's ceilings.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np

from .. import artifacts
from ..config import Profile
from ..errors import ConfigError
from ..optimize import OptimizeArtifact
from ..targets import TargetInfo

log = logging.getLogger(__name__)
STAGE = "profile"


def kernel_costs(mod) -> dict[str, dict]:
    """FLOPs of every PrimFunc in a fused module, and the bytes of the
    tensors each call reads and writes (from the Relax call sites)."""
    from ..build import tensor_types
    from ..tvm_compat import estimate_tir_flops, relax, tirx, tvm

    out = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            try:
                flops = float(estimate_tir_flops(tvm.IRModule({"main": func})))
            except Exception:  # opaque ops: no estimate
                flops = 0.0
            out[gv.name_hint] = {"flops": flops, "bytes": 0}

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", "") == "relax.call_tir":
            name = expr.args[0].name_hint
            if name in out and not out[name]["bytes"]:
                tensors = [t for a in expr.args[1].fields for t in tensor_types(a.ty)]
                tensors += [t for ty in expr.ty_args for t in tensor_types(ty)]
                out[name]["bytes"] = sum(
                    int(np.prod(t["shape"])) * tvm.runtime.DataType(t["dtype"]).bits // 8 for t in tensors
                )

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return out


def run(
    profile: Profile,
    target: TargetInfo,
    opt: OptimizeArtifact,
    database: tuple[Path, dict] | None,
    bucket,
    folder: Path,
    iters: int = 20,
) -> dict:
    from .. import build
    from ..runtime import random_inputs
    from ..tvm_compat import VirtualMachine, VMInstrumentReturnKind, load_module, tensor

    if iters < 1:
        raise ConfigError("--iters must be at least 1", iters)
    dev = target.device()  # fails fast (TargetError) before minutes of compiling
    from ..shapes import as_bucket

    bucket = as_bucket(bucket)
    plain = dataclasses.replace(profile, buckets=(bucket.batch,), cuda_graph=False)
    mod = opt.load_module(bucket)
    costs = kernel_costs(mod)
    with artifacts.staged_dir(folder) as tmp:
        db = None if database is None else (str(database[0]), database[1])
        info, _ = build.build_bucket(str(opt.module_path(bucket)), target, plain, db, str(tmp / "module.so"))
        vm = VirtualMachine(load_module(str(tmp / "module.so")), dev)
        params, _ = build.signature(mod["main"])
        args = [tensor(a, dev) for a in random_inputs([(p["shape"], p["dtype"]) for p in params], None)]
        vm["main"](*args)  # warm-up

        times: dict[str, list[float]] = collections.defaultdict(list)
        started: dict[str, float] = {}

        def instrument(func, func_symbol, before_run, ret_value, *a):
            if func_symbol not in costs:
                return VMInstrumentReturnKind.NO_OP
            dev.sync()
            if before_run:
                started[func_symbol] = time.perf_counter()
            else:
                times[func_symbol].append(time.perf_counter() - started.pop(func_symbol))
            return VMInstrumentReturnKind.NO_OP

        vm.set_instrument(instrument)
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            vm["main"](*args)
        dev.sync()
        wall = (time.perf_counter() - t0) / iters

        total = sum(sum(v) for v in times.values()) / iters
        kernels = []
        for name, ts in times.items():
            per_run = sum(ts) / iters
            calls = len(ts) // iters
            per_call = sum(ts) / len(ts)
            c = costs[name]
            kernels.append({
                "kernel": name,
                "calls_per_run": calls,
                "ms_per_call": per_call * 1e3,
                "ms_per_run": per_run * 1e3,
                "share": per_run / total if total else 0.0,
                "gflops_per_s": c["flops"] / per_call / 1e9 if per_call else 0.0,
                "gbytes_per_s": c["bytes"] / per_call / 1e9 if per_call else 0.0,
                "flops": c["flops"],
                "bytes": c["bytes"],
            })
        kernels.sort(key=lambda k: -k["ms_per_run"])
        report = {
            "bucket": bucket.label if bucket.dims else bucket.batch,
            "target": target.key(),
            "tuned_kernels": info["tuned_kernels"],
            "kernels_total": info["kernels"],
            "iterations": iters,
            "instrumented_ms_per_run": wall * 1e3,
            "kernel_ms_per_run": total * 1e3,
            "kernels": kernels,
        }
        artifacts.write_json_atomic(tmp / "profile.json", report)
        (tmp / "profile.md").write_text(format_report(report))
        artifacts.write_manifest(tmp, STAGE, {"bucket": bucket.label if bucket.dims else bucket.batch}, files=["profile.json", "profile.md", "module.so"])
    return report


def format_report(report: dict, top: int = 0) -> str:
    rows = report["kernels"][:top] if top else report["kernels"]
    lines = [
        f"bucket {report['bucket']}: {report['kernel_ms_per_run']:.3f} ms in kernels per run "
        f"({report['tuned_kernels']}/{report['kernels_total']} kernels tuned; "
        f"each kernel synchronized, so this exceeds the graph-replayed latency)",
        "",
        "| kernel | calls | ms/call | ms/run | share | GFLOP/s | GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in rows:
        lines.append(
            f"| {k['kernel']} | {k['calls_per_run']} | {k['ms_per_call']:.4f} | {k['ms_per_run']:.4f} | "
            f"{k['share']:.1%} | {k['gflops_per_s']:.0f} | {k['gbytes_per_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def load(folder: Path) -> dict:
    artifacts.read_manifest(folder, STAGE)
    return json.loads((Path(folder) / "profile.json").read_text())
