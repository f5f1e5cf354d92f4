"""Host-side cost of putting a batch of requests into a bucket's device
inputs, the two ways the server has done it (no model runs):

  join:  np.concatenate of the requests' arrays, then a fresh device tensor
         (tvm.runtime.tensor: allocate + copy), as the batcher and
         Predictor.run_bucket did before 2026-11-29 evening;
  views: each request's rows copied straight into row views of a device
         tensor allocated once (what Predictor.run_parts does; it also keeps
         the views, which this makes anew every time).

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
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from deploy.tvm_compat import tensor, tensor_view, tvm

    dev = tvm.cuda(0) if args.device == "cuda" else tvm.cpu(0)
    shape = [int(d) for d in args.shape.split(",")]
    row_bytes = int(np.prod(shape)) * 4
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((args.rows, *shape)).astype("float32") for _ in range(args.requests)]
    batch = args.requests * args.rows
    staged = tensor(np.zeros((batch, *shape), "float32"), dev)

    def join():
        t = tensor(np.concatenate(parts), dev)
        dev.sync()
        return t

    def views():
        for k, p in enumerate(parts):
            tensor_view(staged, [args.rows, *shape], k * args.rows * row_bytes).copyfrom(p)
        dev.sync()

    out = {}
    for name, f in (("join", join), ("views", views)):
        f()
        ts = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"p50_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}
    np.testing.assert_array_equal(staged.numpy(), np.concatenate(parts))  # views put every row in its place
    mb = batch * row_bytes / 2**20
    report = {"device": args.device, "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
              "requests": args.requests, "rows_per_request": args.rows, "sample_shape": shape, "batch_mib": mb,
              "iters": args.iters, "results": out}
    lines = [f"# Batch assembly: {args.requests} requests x {args.rows} rows of {shape} fp32 ({mb:.1f} MiB), "
             f"device {args.device}", "", "| way | p50 ms | min ms | max ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['p50_ms']:.2f} | {v['min_ms']:.2f} | {v['max_ms']:.2f} |" for k, v in out.items()]
    lines += ["", f"join / views at p50: {out['join']['p50_ms'] / out['views']['p50_ms']:.1f}x"]
    return results_files.write(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
