"""How long the server's batcher takes for one batch of several requests
(Predictor.run_parts) while another thread runs pure Python, as the HTTP
thread does under load, at several GIL switch intervals (the server's
--gil-switch-ms). Each TVM call drops the GIL; getting it back from a busy
Python thread can take up to the switch interval.

    .venv/bin/python scripts/batcher_gil_bench.py --package artifacts/tiny_cnn/<...>/package \\
        --out results/cpu/2026-11-29/batcher-gil

Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import results_files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True)
    ap.add_argument("--requests", type=int, default=4, help="requests per batch")
    ap.add_argument("--rows", type=int, default=8, help="rows per request")
    ap.add_argument("--switch-ms", default="5,1,0.5,0.2", help="GIL switch intervals to try (ms)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import deploy

    pred = deploy.load(args.package)
    parts = [pred.random_inputs(args.rows, seed=k) for k in range(args.requests)]
    rows = args.requests * args.rows

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            pred.run_parts(parts)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    timed(10)
    results = {"alone": float(np.median(timed(args.iters)))}
    stop = threading.Event()

    def busy() -> None:  # pure Python, like an event loop parsing HTTP
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        for ms in (float(v) for v in args.switch_ms.split(",")):
            sys.setswitchinterval(ms / 1e3)
            timed(5)
            results[f"busy thread, switch {ms:g} ms"] = float(np.median(timed(args.iters)))
    finally:
        stop.set()
        thread.join()
    report = {"package": str(args.package), "requests": args.requests, "rows_per_request": args.rows,
              "batch_rows": rows, "iters": args.iters, "p50_ms": results}
    lines = [f"# One batch of {args.requests} requests x {args.rows} rows through Predictor.run_parts", "",
             "| case | p50 ms |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in results.items()]
    return results_files.write(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
