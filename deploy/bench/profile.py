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
from ..errors import ConfigError, KernelFaultError
from ..optimize import OptimizeArtifact
from ..targets import TargetInfo
from . import sanitize
from .peaks import ceilings, roofline

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
    trace: Path | None = None,
    trace_iters: int = 3,
    debug_kernels: bool = False,
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
        inputs = random_inputs([(p["shape"], p["dtype"]) for p in params], None)
        args = [tensor(a, dev) for a in inputs]
        sanitizer = None
        if debug_kernels:  # before anything else runs: the first fault is the one to name
            fault_dir = Path(folder).parent / "kernel-fault"
            try:
                calls = run_synchronized(vm, dev, args, costs, mod, fault_dir)
            except KernelFaultError as e:  # memcheck, in a process of its own, says which thread and address
                if target.kind != "cuda":
                    raise
                try:
                    line = sanitize.describe(sanitize.run(tmp / "module.so", inputs, fault_dir))
                except Exception as s_err:  # noqa: BLE001 - the fault is what to report
                    line = f"compute-sanitizer: not run: {type(s_err).__name__}: {s_err}"
                err = KernelFaultError(e.what, f"{e.got}; {line}")
                err.device_lost = True  # the CLI exits without the teardown a faulted context aborts
                raise err from e
            log.info("profile: --debug-kernels: %d kernel calls, each synchronized: no fault", calls)
            if target.kind == "cuda":
                sanitizer = sanitize.describe(sanitize.run(tmp / "module.so", inputs, Path(folder).parent / "sanitizer"))
                log.info("profile: --debug-kernels: %s", sanitizer)
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
        peaks = ceilings(target.device_name, profile.precision) if target.kind == "cuda" else None
        if peaks is not None:  # where each kernel stands against the GPU's ceilings, and the time above them
            for k in kernels:
                r = roofline(k["flops"], k["bytes"], k["ms_per_call"] / 1e3, peaks)
                k.update(bound=r["bound"], of_roofline=r["of_roofline"],
                         loss_ms_per_run=max(0.0, k["ms_per_call"] / 1e3 - r["roofline_s"]) * k["calls_per_run"] * 1e3)
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
            "ceilings": peaks,
        }
        if sanitizer is not None:
            report["sanitizer"] = sanitizer
        if trace is not None:
            vm.set_instrument(None)
            events = timeline(vm, dev, args, costs, trace_iters, target)
            report["trace"] = str(trace)
        artifacts.write_json_atomic(tmp / "profile.json", report)
        (tmp / "profile.md").write_text(format_report(report))
        artifacts.write_manifest(tmp, STAGE, {"bucket": bucket.label if bucket.dims else bucket.batch}, files=["profile.json", "profile.md", "module.so"])
    if trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        artifacts.write_json_atomic(Path(trace), chrome_trace(events, report))
    return report


KERNEL_LANE, COPY_LANE = 1, 2


def _describe(arg) -> str:
    shape = getattr(arg, "shape", None)
    if shape is not None and hasattr(arg, "dtype"):
        return f"{arg.dtype}{list(int(d) for d in shape)}"
    return type(arg).__name__


def run_synchronized(vm, dev, args, costs: dict, mod, fault_dir: Path) -> int:
    """One run with a device synchronization after every kernel, so that an
    asynchronous fault (an illegal memory access reported by a later call)
    is caught at the kernel that caused it. Raises KernelFaultError naming
    the kernel and its arguments' shapes, with its TIR written to
    `fault_dir/<kernel>.tir`; returns the number of kernel calls."""
    from ..tvm_compat import VMInstrumentReturnKind

    state = {"calls": 0, "fault": None}

    def instrument(func, func_symbol, before_run, ret_value, *a):
        if func_symbol not in costs:
            return VMInstrumentReturnKind.NO_OP
        if before_run:
            state["current"] = (func_symbol, [_describe(x) for x in a])
            state["running"] = True
            return VMInstrumentReturnKind.NO_OP
        state["running"] = False
        try:
            dev.sync()
        except Exception as e:  # noqa: BLE001 - the fault, recorded and raised again
            state["fault"] = (*state["current"], e)
            raise
        state["calls"] += 1
        return VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
        dev.sync()
    except Exception as e:  # noqa: BLE001 - a fault is said in one line; anything else is not ours to name
        if state["fault"] is None and state.get("running"):  # the call itself failed (a launch failure)
            state["fault"] = (*state["current"], e)
        if state["fault"] is None:
            raise
        kernel, shapes, err = state["fault"]
        fault_dir.mkdir(parents=True, exist_ok=True)
        tir = fault_dir / f"{kernel}.tir"
        func = next((f for gv, f in mod.functions.items() if gv.name_hint == kernel), None)
        tir.write_text(f"# {err}\n# arguments: {', '.join(shapes)}\n# the kernel before scheduling (the build's "
                       "manifest names the schedule it got)\n" + (func.script() if func is not None else ""))
        first = next((ln.strip() for ln in reversed(str(err).strip().splitlines()) if ln.strip()), type(err).__name__)
        raise KernelFaultError(f"kernel '{kernel}' faulted (call {state['calls'] + 1} of the run, after every earlier "
                               f"kernel completed): {first}", f"arguments {', '.join(shapes)}; TIR in {tir}") from e
    finally:
        vm.set_instrument(None)
    return state["calls"]


def timeline(vm, dev, args, costs: dict, iters: int, target: TargetInfo) -> list[dict]:
    """`iters` runs of the bucket as trace events: each kernel call on the
    kernel lane (the one stream TVM launches on), and on a GPU the inputs'
    host-to-device and the outputs' device-to-host copies on their own lane.
    Each event is bracketed by device synchronizations, as the report's
    timings are."""
    from ..runtime import outputs_to_numpy
    from ..tvm_compat import VMInstrumentReturnKind

    host = [a.numpy() for a in args]
    gpu = target.kind == "cuda"
    events: list[dict] = []
    started: dict[str, float] = {}
    state = {"iteration": 0}
    t0 = time.perf_counter()

    def event(name: str, cat: str, lane: int, start: float, end: float, **extra) -> dict:
        e = {"name": name, "cat": cat, "ph": "X", "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "pid": 1,
             "tid": lane, "args": {"iteration": state["iteration"], **extra}}
        events.append(e)
        return e

    def instrument(func, func_symbol, before_run, ret_value, *a):
        if func_symbol not in costs:
            return VMInstrumentReturnKind.NO_OP
        dev.sync()
        now = time.perf_counter()
        if before_run:
            started[func_symbol] = now
        else:
            start, c = started.pop(func_symbol), costs[func_symbol]
            dur = max(now - start, 1e-9)
            event(func_symbol, "kernel", KERNEL_LANE, start, now, gflops_per_s=round(c["flops"] / dur / 1e9, 2),
                  gbytes_per_s=round(c["bytes"] / dur / 1e9, 2))
        return VMInstrumentReturnKind.NO_OP

    def copy(name: str, fn):
        dev.sync()
        start = time.perf_counter()
        result = fn()
        dev.sync()
        end = time.perf_counter()
        nbytes = sum(h.nbytes for h in (host if result is None else result))
        event(name, "copy", COPY_LANE, start, end, bytes=nbytes,
              gbytes_per_s=round(nbytes / max(end - start, 1e-9) / 1e9, 2))
        return result

    def upload():
        for a, h in zip(args, host):
            a.copyfrom(h)

    vm.set_instrument(instrument)
    try:
        for i in range(iters):
            state["iteration"] = i
            if gpu:
                copy("inputs host->device", upload)
            out = vm["main"](*args)
            if gpu:
                copy("outputs device->host", lambda out=out: outputs_to_numpy(out))
    finally:
        vm.set_instrument(None)
    return events


def chrome_trace(events: list[dict], report: dict) -> dict:
    """The Chrome trace event format (JSON object form), which
    ui.perfetto.dev and chrome://tracing open."""
    where = f"{report['target']} bucket {report['bucket']}"
    meta = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"tvm-deploy {where}"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": KERNEL_LANE, "args": {"name": "kernels (stream 0)"}},
        {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": KERNEL_LANE, "args": {"sort_index": 0}},
    ]
    if any(e["tid"] == COPY_LANE for e in events):
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": COPY_LANE,
                  "args": {"name": "host<->device copies"}},
                 {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": COPY_LANE, "args": {"sort_index": 1}}]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"source": "tvm-deploy profile", "bucket": str(report["bucket"]),
                          "target": report["target"], "note": "each event between device synchronizations"}}


def format_report(report: dict, top: int = 0) -> str:
    rows = report["kernels"][:top] if top else report["kernels"]
    peaks = report.get("ceilings")
    lines = [
        f"bucket {report['bucket']}: {report['kernel_ms_per_run']:.3f} ms in kernels per run "
        f"({report['tuned_kernels']}/{report['kernels_total']} kernels tuned; "
        f"each kernel synchronized, so this exceeds the graph-replayed latency)",
    ]
    if peaks is not None:
        loss = sum(k["loss_ms_per_run"] for k in report["kernels"])
        worst = sorted(report["kernels"], key=lambda k: -k["loss_ms_per_run"])[:3]
        lines.append(f"{loss:.3f} ms per run above the kernels' rooflines ({peaks['source']}); most: "
                     + ", ".join(f"{k['kernel']} {k['loss_ms_per_run']:.3f} ms ({k['bound']}-bound, "
                                 f"{k['of_roofline']:.0%} of its roofline)" for k in worst))
    if report.get("sanitizer"):
        lines.append(report["sanitizer"])
    head = "| kernel | calls | ms/call | ms/run | share | GFLOP/s | GB/s |"
    lines += ["", head + (" roofline | bound | above roofline ms/run |" if peaks else ""),
              "|---" * (head.count("|") - 1 + (3 if peaks else 0)) + "|"]
    for k in rows:
        lines.append(
            f"| {k['kernel']} | {k['calls_per_run']} | {k['ms_per_call']:.4f} | {k['ms_per_run']:.4f} | "
            f"{k['share']:.1%} | {k['gflops_per_s']:.0f} | {k['gbytes_per_s']:.1f} |"
            + (f" {k['of_roofline']:.0%} | {k['bound']} | {k['loss_ms_per_run']:.4f} |" if peaks else "")
        )
    return "\n".join(lines) + "\n"


def load(folder: Path) -> dict:
    artifacts.read_manifest(folder, STAGE)
    return json.loads((Path(folder) / "profile.json").read_text())
