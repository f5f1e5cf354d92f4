"""Host-side cost of putting a batch of requests into a bucket's device
inputs, the two ways the server has done it (no model runs):

  join:  np.concatenate of the requests' arrays, then a fresh device tensor
         (tvm.runtime.tensor: allocate + copy), as the batcher and
         Predictor.run_bucket did before 2026-11-29 evening;
  views: each request's rows copied straight into row views of a device
         tensor allocated once (what Predictor.run_parts does; it also keeps
         the views, which this makes anew every time);
and, on a GPU (--device cuda), the parts of a pinned-memory way:
  views+pad:   views, then zeros into the bucket's padding rows (--bucket);
  to-pinned:   the requests' rows copied (numpy) into a page-locked host
               buffer (TVM's cuda_host device);
  pinned-h2d:  that buffer's used rows copied to the device in one copy;
  pinned:      both, one after the other.
With --package, also how long the bucket's module call takes to return
(kernels queued) against its run to the end (device synchronized).

    .venv/bin/python scripts/assembly_bench.py --out results/cpu/2026-11-29/batch-assembly
    (on a GPU machine: --device cuda)

Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import results_files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deploy/, also without the venv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=8, help="requests per batch")
    ap.add_argument("--rows", type=int, default=8, help="rows (samples) per request")
    ap.add_argument("--shape", default="3,224,224", help="one sample's shape (ResNet-50's input by default)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--bucket", type=int, default=0, help="rows of the bucket padded to (views+pad); default: no padding")
    ap.add_argument("--package", help="a package built for --device: time its --bucket module's call")
    ap.add_argument("--stage-threads", type=int, default=4, help="threads of the staging copies to compare with 1")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from deploy.tvm_compat import tensor, tensor_view, tvm

    dev = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    shape = [int(d) for d in args.shape.split(",")]
    dt = args.dtype
    row_bytes = int(np.prod(shape)) * np.dtype(dt).itemsize
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((args.rows, *shape)).astype(dt) for _ in range(args.requests)]
    batch = args.requests * args.rows
    bucket = max(args.bucket, batch)
    staged = tensor(np.zeros((bucket, *shape), dt), dev)
    zeros = np.zeros((bucket - batch, *shape), dt)

    def join():
        t = tensor(np.concatenate(parts), dev)
        dev.sync()
        return t

    def views():
        for k, p in enumerate(parts):
            tensor_view(staged, [args.rows, *shape], k * args.rows * row_bytes).copyfrom(p)
        dev.sync()

    ways = [("join", join), ("views", views)]

    # The server's staging copies (Predictor._copy_all): the requests' rows into
    # a host buffer of the bucket, in the calling thread or spread over threads.
    from types import SimpleNamespace

    from deploy import runtime

    host_buf = np.empty((bucket, *shape), dt)
    stage_copies = [(k, host_buf[k * args.rows : (k + 1) * args.rows], p) for k, p in enumerate(parts)]
    for threads in sorted({1, args.stage_threads}):
        state = SimpleNamespace(_stage_threads=threads, _stage_pool=None)
        ways.append((f"stage, {threads} thread(s)", lambda s=state: runtime.Predictor._copy_all(s, stage_copies)))
    pinned_error = None
    if args.device == "cuda":
        from deploy.tvm_compat import tvm_ffi

        pinned = tvm.runtime.empty((bucket, *shape), dt, tvm_ffi.Device(3, 0))  # kDLCUDAHost: cudaMallocHost
        try:
            host = np.from_dlpack(pinned)  # a view, no copy
        except Exception as e:  # numpy that refuses page-locked host memory: say so, measure the rest
            pinned_error = f"np.from_dlpack of a cuda_host tensor: {type(e).__name__}: {e}"
            print(pinned_error)
        used_host = tensor_view(pinned, [batch, *shape], 0)
        used_dev = tensor_view(staged, [batch, *shape], 0)

        def views_pad():
            views()
            if bucket > batch:
                tensor_view(staged, [bucket - batch, *shape], batch * row_bytes).copyfrom(zeros)
            dev.sync()

        def to_pinned():
            for k, p in enumerate(parts):
                np.copyto(host[k * args.rows : (k + 1) * args.rows], p)

        def pinned_h2d():
            used_dev.copyfrom(used_host)  # tensor to tensor: an async copy, then the sync below
            dev.sync()

        def both():
            to_pinned()
            pinned_h2d()

        def pinned_full():  # the whole bucket, tensor to tensor (no views)
            staged.copyfrom(pinned)
            dev.sync()

        out_dev = tensor(np.ones((bucket, 1000), dt), dev)
        out_host = tvm.runtime.empty((bucket, 1000), dt, tvm_ffi.Device(3, 0))

        def d2h_pinned():  # a (bucket, 1000) output back into page-locked memory
            out_dev.copyto(out_host)
            dev.sync()

        def sync_idle():
            dev.sync()

        ways.append(("views+pad", views_pad))
        if pinned_error is None:
            ways += [("to-pinned", to_pinned), ("pinned-h2d", pinned_h2d), ("pinned", both),
                     ("pinned-full-bucket-h2d", pinned_full), ("d2h-pinned (bucket x 1000)", d2h_pinned),
                     ("sync, device idle", sync_idle)]

    out = {}
    for name, f in ways:
        f()
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = stats(ts)
    np.testing.assert_array_equal(staged.numpy()[:batch], np.concatenate(parts))  # every row in its place
    if args.package:
        out.update(module_call(args.package, bucket, args.iters))
    mb = batch * row_bytes / 2**20
    report = {"device": args.device, "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
              "requests": args.requests, "rows_per_request": args.rows, "sample_shape": shape, "batch_mib": mb,
              "dtype": dt, "bucket": bucket, "package": args.package, "pinned_error": pinned_error,
              "iters": args.iters, "results": out}
    lines = [f"# Batch assembly: {args.requests} requests x {args.rows} rows of {shape} {dt} ({mb:.1f} MiB), "
             f"bucket {bucket}, device {args.device}", "", "| way | p50 ms | min ms | max ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['p50_ms']:.2f} | {v['min_ms']:.2f} | {v['max_ms']:.2f} |" for k, v in out.items()]
    lines += ["", f"join / views at p50: {out['join']['p50_ms'] / out['views']['p50_ms']:.1f}x"]
    return results_files.write(args.out, report, lines)


def module_call(package: str, bucket: int, iters: int) -> dict:
    """The bucket's module: time until its call returns, and until the
    device is done with it."""
    from deploy.runtime import load

    p = load(package, warn_unvalidated=False)
    args = p._staged(bucket)
    vm = p._vms[bucket]["main"]
    vm(*args)
    p.device.sync()
    ret, done = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        vm(*args)
        t1 = time.perf_counter()
        p.device.sync()
        t2 = time.perf_counter()
        ret.append((t1 - t0) * 1e3)
        done.append((t2 - t0) * 1e3)
    return {f"module b{bucket}: call returns": stats(ret), f"module b{bucket}: device done": stats(done)}


def stats(ts: list[float]) -> dict:
    return {"p50_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}


if __name__ == "__main__":
    raise SystemExit(main())
