"""Each convolution of a tuning database against cuDNN on the same shape.

For every workload of a database that is a 2-D convolution in NHWC with
OHWI weights (ResNet-50's, at the database's batch), TVM's time for it: the
faster of its best record's mean time at tuning and its default schedule's
time from the kernel check, as `scripts/db_kernels.py` reads them (records
the check rejected are not left out, and the build picks by the check's
own verdicts, so read it as what the package runs within noise), beside
PyTorch's `conv2d` with a bias on the same shape (cuDNN, channels last,
`cudnn.benchmark`, CUDA events), each with its TFLOP/s against the GPU's
peak. What issue 19 asks where a target is out of reach: the best
kernel found for each large convolution against cuDNN.

    python3 scripts/conv_vs_cudnn.py tuning_logs/resnet50/cuda-sm_90-nvidia-h200/fp16-nhwc-b64 --out DIR

Writes DIR/conv_vs_cudnn.md and .json. The convolution's parameters are read
from the buffers' shapes: the padding is (kernel - 1) / 2 (none where the
kernel and the stride are equal, a patchifying stem), the stride the one
that gives the output's size. The TVM time includes the kernel's fused
epilogue (bias, ReLU, a residual add); cuDNN's row has the bias only.
`--device cpu --dtype float32` runs the same table on the CPU (a check of
the script, not a comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import db_kernels  # noqa: E402 - scripts/db_kernels.py, beside this file
import probe_common  # noqa: E402 - scripts/probe_common.py


def conv_params(shapes: list[str]) -> dict | None:
    """The convolution a workload's buffers describe, or None: input
    [N, H, W, C], weight [O, KH, KW, C] (first two buffers), output
    [N, OH, OW, O] (last)."""
    try:
        dims = [[int(d) for d in s.split(",")] for s in shapes]
    except ValueError:
        return None
    if len(dims) < 3 or any(len(d) != 4 for d in (dims[0], dims[1], dims[-1])):
        return None
    (n, h, w, c), (o, kh, kw, ci), (n2, oh, ow, o2) = dims[0], dims[1], dims[-1]
    if n != n2 or o != o2 or ci != c or kh != kw:
        return None
    for stride in (1, 2, 3, 4):
        pad = 0 if kh == stride else (kh - 1) // 2
        if (h + 2 * pad - kh) // stride + 1 == oh and (w + 2 * pad - kw) // stride + 1 == ow:
            return {"batch": n, "height": h, "width": w, "in_channels": c, "out_channels": o, "kernel": kh,
                    "stride": stride, "padding": pad, "out_height": oh, "out_width": ow,
                    "gflop": 2.0 * n * oh * ow * o * kh * kw * c / 1e9}
    return None


def time_torch(p: dict, device: str, dtype: str, iters: int) -> float:
    """Microseconds a call of torch's conv2d (+ bias) takes on this shape."""
    import time

    import torch

    dt = getattr(torch, dtype)
    torch.backends.cudnn.benchmark = True
    x = torch.randn(p["batch"], p["in_channels"], p["height"], p["width"], device=device, dtype=dt)
    x = x.to(memory_format=torch.channels_last)
    wt = torch.randn(p["out_channels"], p["in_channels"], p["kernel"], p["kernel"], device=device, dtype=dt)
    wt = wt.to(memory_format=torch.channels_last)
    b = torch.randn(p["out_channels"], device=device, dtype=dt)

    def call():
        return torch.nn.functional.conv2d(x, wt, b, stride=p["stride"], padding=p["padding"])

    if device == "cuda":
        return probe_common.cuda_event_us(call, iters=iters)
    call()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a database folder (…/<target>/<profile>-b<batch>)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="float16", choices=("float16", "float32"))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--limit", type=int, default=0, help="the first N convolutions only (0: all)")
    a = ap.parse_args(argv)
    if not (a.folder / "database_workload.json.xz").is_file() and not (a.folder / "database_workload.json").is_file():
        print(f"error: no tuning database in {a.folder} | expected database_workload.json(.xz) there", file=sys.stderr)
        return 2
    if a.iters < 1 or a.limit < 0:
        print(f"error: --iters must be at least 1 and --limit at least 0 | got {a.iters}, {a.limit}", file=sys.stderr)
        return 2
    precision = a.folder.name.split("-")[0]  # (…/<profile>-b<batch>: fp16-nhwc-b64)
    if precision in ("fp16", "fp32") and precision != {"float16": "fp16", "float32": "fp32"}[a.dtype]:
        print(f"error: --dtype {a.dtype} against a {precision} database | give --dtype "
              f"{'float16' if precision == 'fp16' else 'float32'}", file=sys.stderr)
        return 2
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device for torch | run it on the GPU machine, or --device cpu to check the script",
              file=sys.stderr)
        return 2
    from deploy.bench import peaks

    peak = peaks.ceilings(torch.cuda.get_device_name(), "fp16" if a.dtype == "float16" else "fp32") \
        if a.device == "cuda" else None
    peak_tflops = round(peak["flops_per_s"] / 1e12, 1) if peak else None
    rows = []
    for r in db_kernels.rows(a.folder):
        p = conv_params(r["shapes"])
        if p is None:
            continue
        times = [t for t in (r["best_us"], r["default_us"]) if t]
        if not times:
            continue
        tvm_us = min(times)
        torch_us = time_torch(p, a.device, a.dtype, a.iters)
        rows.append({**p, "workload": r["workload"], "tvm_us": round(tvm_us, 2),
                     "tvm_from": f"tuned, {r['tensor_cores']}" if tvm_us == r["best_us"] else "default",
                     "torch_us": round(torch_us, 2),
                     "tvm_tflops": round(p["gflop"] / tvm_us * 1e3, 1),  # (GFLOP per us = PFLOP/s)
                     "torch_tflops": round(p["gflop"] / torch_us * 1e3, 1),
                     "tvm_over_torch": round(tvm_us / torch_us, 2)})
        print(json.dumps(rows[-1]), flush=True)
        if a.limit and len(rows) >= a.limit:
            break
    rows.sort(key=lambda x: -x["tvm_us"])
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    (a.out / "conv_vs_cudnn.json").write_text(json.dumps({"device": device, "dtype": a.dtype, "folder": str(a.folder),
                                                          "peak_tflops": peak_tflops, "rows": rows}, indent=1) + "\n")
    total_tvm, total_torch = sum(r["tvm_us"] for r in rows), sum(r["torch_us"] for r in rows)
    pct = (lambda t: f" ({t / peak_tflops:.0%})") if peak_tflops else (lambda t: "")
    lines = [f"{device}, {a.dtype}, database {a.folder}: each convolution once (a model may call one several times)",
             f"sum: TVM {total_tvm:.1f} us, torch {total_torch:.1f} us"
             + (f", peak {peak_tflops} TFLOP/s" if peak_tflops else ""), "",
             "| input NHWC | kernel, stride | out channels | GFLOP | TVM us (from) | TVM TFLOP/s | torch us | "
             "torch TFLOP/s | TVM / torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']}x{r['height']}x{r['width']}x{r['in_channels']} | {r['kernel']}x{r['kernel']}, "
                     f"{r['stride']} | {r['out_channels']} | {r['gflop']:.2f} | {r['tvm_us']} ({r['tvm_from']}) |"
                     f" {r['tvm_tflops']}{pct(r['tvm_tflops'])} | {r['torch_us']} | "
                     f"{r['torch_tflops']}{pct(r['torch_tflops'])} | {r['tvm_over_torch']} |")
    (a.out / "conv_vs_cudnn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
