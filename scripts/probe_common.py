"""What the kernel probes in scripts/ share: the fp16 GEMM task they probe
MetaSchedule's rules with (`gemm_module`), how they time a kernel (torch's
by CUDA events, TVM's by its time_evaluator, the median of its repeats; in
microseconds a call), how the GEMM probes measure a configuration and the
cuBLAS row beside it, how they write their results (probe.json and a
probe.md table), and a fused kernel of one Relax op chain (`fused_kernel`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path


def optimize_model(name: str, target, batch: int, precision: str, work: Path, implicit_gemm: bool = False):
    """A corpus model's optimize artifact for one batch on `target` (a
    TargetInfo), as the pipeline makes it: export, frontend, optimize in
    `work`, the profile's implicit_gemm as asked (false: off, also where
    the default would make them on sm_90)."""
    from deploy import config, export, frontend, optimize

    cfg = config.from_dict({"model": {"source": name},
                            target.kind: {"buckets": [batch], "tune_buckets": [batch], "precision": precision,
                                          "implicit_gemm": implicit_gemm}})
    profile = cfg.profile(target.kind)
    ex = export.run(cfg, work / "export")
    fe = frontend.run(profile, ex, work / "frontend")
    return optimize.run(profile, target, fe, work / "optimize")


def gemm_module(m: int, n: int, k: int, epilogue: str):
    """An IRModule of C[m, n] = sum_k A[m, k] B[k, n] (fp16 in, fp32 sum),
    then the epilogue: `none`, `cast` (to fp16) or `bias-relu` (cast, a bias
    and ReLU, as in a fused convolution)."""
    from tvm import te, topi

    from deploy.tvm_compat import tvm

    a = te.placeholder((m, k), "float16", name="a")
    b = te.placeholder((k, n), "float16", name="b")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                   name="c")
    args = [a, b]
    if epilogue in ("cast", "bias-relu"):
        c = topi.cast(c, "float16")
    if epilogue == "bias-relu":
        bias = te.placeholder((n,), "float16", name="bias")
        args.append(bias)
        c = topi.nn.relu(topi.add(c, bias))
    return tvm.IRModule({"main": te.create_prim_func([*args, c]).with_attr("global_symbol", "main")})


def cuda_event_us(fn, iters: int = 100, warmup: int = 10) -> float:
    """Microseconds a call of `fn` (which launches torch CUDA work) takes."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def tvm_us(lib, dev, *args, name: str = "main", number: int = 50, repeat: int = 5) -> float:
    """Microseconds a call of a built TVM module's function `name` takes (median of the repeats)."""
    import numpy as np

    ev = lib.time_evaluator(name, dev, number=number, repeat=repeat)(*args)
    return float(np.median(ev.results)) * 1e6


def torch_row(shape: str, config: str, fn, flop: float) -> dict:
    """The row of torch's own kernels (`fn`, timed by CUDA events) on a GEMM shape, printed."""
    return timed_row(shape, config, cuda_event_us(fn), flop)


def timed_row(shape: str, config: str, t_us: float, flop: float) -> dict:
    """A row of a library's time on a shape (its TFLOP/s from `flop`), printed."""
    row = {"shape": shape, "config": config, "us": round(t_us, 2), "tflops": round(flop / t_us / 1e6, 1)}
    print(row, flush=True)
    return row


def measure(row: dict, build, checks: dict, run_args: tuple | None, arch: str) -> dict:
    """`row` (shape, config) with what building one configuration gave:
    `build()`'s time, which of `checks` ({field: text}) its CUDA source
    holds, then on the GPU (`run_args`: run_and_time's arguments after the
    module) its rel_l2 and time, else nvcc's registers for `arch`; where
    anything raises, its last line as the row's error. Printed."""
    t0 = time.time()
    try:
        lib = build()
        src = lib.mod.imports[0].inspect_source() if lib.mod.imports else ""
        row.update(build_s=round(time.time() - t0, 1), **{field: text in src for field, text in checks.items()})
        if run_args is not None:
            row.update(run_and_time(lib, *run_args))
        elif src:  # registers and spills, from nvcc (compiled as NVRTC would on the GPU)
            row["ptxas"] = nvcc_usage(src, row["config"], arch)
    except Exception as e:  # noqa: BLE001 - a probe records what fails
        row["error"] = error_line(e)
    print(row, flush=True)
    return row


def run_and_time(lib, inputs: list, out_shape, out_dtype: str, ref, flop: float) -> dict:
    """Runs a built kernel's `main` on the GPU (inputs as NumPy arrays, then
    the output), and returns its rel_l2 against `ref`, its time and TFLOP/s.
    `lib`: what tvm.compile gives, or a runtime module (deploy.build.build_kernel)."""
    import numpy as np

    from deploy.tvm_compat import tvm

    dev = tvm.cuda(0)
    arrays = [tvm.runtime.tensor(x, dev) for x in inputs]
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype), dev)
    lib["main"](*arrays, out)
    got = out.numpy().astype("float32")
    t_us = tvm_us(getattr(lib, "mod", lib), dev, *arrays, out)
    return {"rel_l2": f"{float(np.linalg.norm(got - ref) / np.linalg.norm(ref)):.2e}", "us": round(t_us, 2),
            "tflops": round(flop / t_us / 1e6, 1)}


def fused_kernel(build, shape, dtype: str, target, more=()):
    """The one fused PrimFunc of a Relax function of one input `x` (`shape`,
    `dtype`) whose body is `build(x)`, legalized and fused as the pipeline
    does; `more`: the shapes of more inputs of `dtype`, `build(x, *those)`."""
    from deploy.tvm_compat import PassContext, relax, tirx

    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{i}" if i else "x", relax.TensorType(s, dtype)) for i, s in enumerate([shape, *more])]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(build(*xs))
        bb.emit_func_output(out)
    with target, PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(bb.get())
        mod = relax.transform.AnnotateTIROpPattern()(mod)
        mod = relax.transform.FuseTIR()(relax.transform.FuseOps()(mod))
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def run_schedules(func, scheduled: dict, info) -> tuple[list, dict, dict]:
    """Seeded arguments of `func` (host arrays), and for each label of
    `scheduled` (label: a schedule of `func`, a PrimFunc) its output on the
    GPU and its microseconds a call (`tvm_us`, 100 runs a repeat)."""
    import numpy as np

    from deploy.build import build_kernel
    from deploy.tvm_compat import ms, tvm

    dev = tvm.cuda(0)
    host = [np.random.default_rng(0).standard_normal([int(d) for d in a.shape]).astype(str(a.dtype))
            for a in ms.arg_info.ArgInfo.from_prim_func(func)]
    outs, us = {}, {}
    for label, fn in scheduled.items():
        lib = build_kernel("k", fn, info)
        dev_args = [tvm.runtime.tensor(a, dev) for a in host]
        lib["k"](*dev_args)
        outs[label] = dev_args[-1].numpy()
        us[label] = round(tvm_us(lib, dev, *dev_args, name="k", number=100), 2)
    return host, outs, us


def write_kernel_probe(out: Path, rows: list[dict], note: str, table: list[str]) -> None:
    """A kernel probe's results: out/probe.json ({"device", "rows"}) and
    out/probe.md ("device: <the GPU>; `note`", then the `table` lines)."""
    import torch

    from deploy.tvm_compat import tvm

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else str(tvm.cuda(0))
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"device": gpu, "rows": rows}, indent=1))
    (out / "probe.md").write_text("\n".join([f"device: {gpu}; {note}", "", *table]) + "\n")


def error_line(e: Exception) -> str:
    """The last line of an exception's message (a probe records what fails, no trace)."""
    lines = str(e).strip().splitlines()
    return (lines[-1] if lines else type(e).__name__)[:200]


def write_results(out: Path, header: str, meta: dict, rows: list[dict], extra_column: str,
                  shape_column: str = "shape MxNxK") -> None:
    """probe.json ({**meta, "rows": rows}) and probe.md: `header`, then a
    row per measurement (shape, config, us, TFLOP/s, rel_l2, the row's
    `extra_column` entry, error)."""
    (out / "probe.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [header, "", f"| {shape_column} | config | us | TFLOP/s | rel_l2 | {extra_column} | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['config']} | {r.get('us', '')} | {r.get('tflops', '')} | "
                     f"{r.get('rel_l2', '')} | {r.get(extra_column, '')} | {r.get('error', '')} |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")


def parse_shapes(text: str) -> list[tuple[int, int, int]] | None:
    """`MxNxK,...` as tuples; None (after one line on stderr) where it is not that."""
    shapes = []
    for part in text.split(","):
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", part.strip()):
            print(f"error: not a GEMM shape: {part!r} | expected MxNxK, e.g. 6272x1536x384", file=sys.stderr)
            return None
        shapes.append(tuple(int(x) for x in part.strip().split("x")))
    return shapes


def parse_ints(text: str, what: str, choices: tuple[int, ...] | None = None) -> list[int] | None:
    """`a,b,...` positive integers (or, given `choices`, each one of them);
    None (after one line on stderr) where not."""
    number = r"\d+" if choices else r"[1-9]\d*"
    if not re.fullmatch(rf"{number}(,{number})*", text.strip()) or \
            (choices and any(int(x) not in choices for x in text.split(","))):
        expected = "positive integers" if choices is None else " or ".join(map(str, choices))
        print(f"error: {what} must be {expected} separated by commas | got {text!r}", file=sys.stderr)
        return None
    return [int(x) for x in text.split(",")]


def exit_code(rows: list[dict]) -> int:
    """0 where at least one configuration built (and, on a GPU, ran); 1
    where every one failed (each failure is in the results)."""
    ours = [r for r in rows if not r["config"].startswith("torch")]
    return 0 if any("error" not in r for r in ours) else 1


def nvcc_usage(src: str, name: str, arch: str) -> str:
    """ptxas's registers/spills line for a kernel's CUDA source, compiled
    with nvcc in a temporary folder; the error's last line where nvcc
    fails, '' where there is none."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="probe-nvcc-") as tmp:
        path = Path(tmp) / (re.sub(r"[^\w.-]", "_", name) + ".cu")
        path.write_text(src)
        try:
            r = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-o", str(path.with_suffix(".cubin")),
                                "--resource-usage", str(path)], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return ""
    if r.returncode:
        return "nvcc failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:150]
    info = [ln.split(":", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("ptxas info")]
    return " ".join(i for i in info if "registers" in i or "spill" in i)
