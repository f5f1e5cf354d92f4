"""How fast can a tensor-core GEMM that TVM 0.27 generates run, written by hand
instead of drawn by MetaSchedule's rules? Builds fp16 GEMMs (fp32
accumulation and output) under deploy/passes/mma_gemm.py's `mma.sync`
schedule (m16n8k16 through TVM's 16x16x16 intrinsics, operands staged in
dynamic shared memory by 16-byte copies, `ldmatrix` into registers, and a
software pipeline over the K tiles: `cp.async`, unless `--no-async`), in
configurations beyond the tuner's (two stages among them). Each config is one block tile and
pipeline depth. On a GPU it checks the result against PyTorch and times
both (TVM's time_evaluator; torch.matmul, i.e. cuBLAS, with CUDA events);
without one it only builds (`--target cuda:sm_90`), to see what lowers.

    python scripts/mma_gemm_probe.py --shapes 4096x4096x4096,6400x1536x384 --out DIR

Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.passes import mma_gemm  # noqa: E402 - after the path (no TVM import at this point)

# The tuner's configurations (deploy/passes/mma_gemm.py), and a two-stage
# pipeline it leaves out: (block rows, block cols, warps along rows, warps
# along cols, K tile, stages)
CONFIGS = {"128x128x32-w2x2-s2": (128, 128, 2, 2, 32, 2), **mma_gemm.CONFIGS}


def gemm_func(m: int, n: int, k: int):
    from tvm import te

    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((k, n), "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                   name="C")
    return te.create_prim_func([a, b, c])


def schedule(func, m: int, n: int, k: int, bm: int, bn: int, wm: int, wn: int, bk: int, stages: int):
    """deploy/passes/mma_gemm.py's schedule under this configuration. Raises
    when the shape does not tile (M % bm, N % bn, K % bk)."""
    if m % bm or n % bn or k % bk:
        raise ValueError(f"{m}x{n}x{k} does not tile by {bm}x{bn}x{bk}")
    return mma_gemm.schedule(func, mma_gemm.match(func), (bm, bn, wm, wn, bk, stages))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x4096x4096,6400x1536x384,6400x384x1536,6400x1152x384")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--target", default=None, help="default: cuda on a GPU, else cuda:sm_90")
    p.add_argument("--no-async", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import numpy as np
    import tvm

    gpu = tvm.cuda(0).exist
    from deploy import targets

    target = targets.resolve(args.target or ("cuda" if gpu else "cuda:sm_90")).tvm_target()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    torch = None
    if gpu:
        import torch
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        flop = 2.0 * m * n * k
        ref = None
        if gpu:
            rng = np.random.default_rng(0)
            a_np = (rng.standard_normal((m, k)) / 8).astype("float16")
            b_np = (rng.standard_normal((k, n)) / 8).astype("float16")
            ta, tb = torch.from_numpy(a_np).cuda(), torch.from_numpy(b_np).cuda()
            ref = (ta.float() @ tb.float()).cpu().numpy()
            for _ in range(10):
                torch.matmul(ta, tb)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                torch.matmul(ta, tb)
            end.record()
            torch.cuda.synchronize()
            t_us = start.elapsed_time(end) / 100 * 1e3
            rows.append({"shape": shape, "config": "torch.matmul (cuBLAS)", "us": round(t_us, 2),
                         "tflops": round(flop / t_us / 1e6, 1)})
            print(rows[-1], flush=True)
        for name in args.configs.split(","):
            bm, bn, wm, wn, bk, st = CONFIGS[name]
            row = {"shape": shape, "config": name + ("" if args.no_async else "-async")}
            t0 = time.time()
            try:
                sch = schedule(gemm_func(m, n, k), m, n, k, bm, bn, wm, wn, bk, st)
                with tvm.transform.PassContext(opt_level=3, config={"tirx.use_async_copy": not args.no_async}):
                    lib = tvm.compile(sch.mod, target=target)
                src = lib.mod.imports[0].inspect_source() if lib.mod.imports else ""
                row.update(build_s=round(time.time() - t0, 1), cp_async="cp.async" in src,
                           ldmatrix="ldmatrix" in src, mma="mma.sync" in src)
                if gpu:
                    dev = tvm.cuda(0)
                    a, b = tvm.runtime.tensor(a_np, dev), tvm.runtime.tensor(b_np, dev)
                    d = tvm.runtime.tensor(np.zeros((m, n), "float32"), dev)
                    lib["main"](a, b, d)
                    got = d.numpy().astype("float32")
                    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    row["rel_l2"] = f"{rel:.2e}"
                    ev = lib.mod.time_evaluator("main", dev, number=50, repeat=5)(a, b, d)
                    t_us = float(np.median(ev.results)) * 1e6
                    row.update(us=round(t_us, 2), tflops=round(flop / t_us / 1e6, 1))
            except Exception as e:  # noqa: BLE001 - a probe records what fails
                lines = str(e).strip().splitlines()
                row["error"] = (lines[-1] if lines else type(e).__name__)[:200]
            rows.append(row)
            print(row, flush=True)
    dev_name = torch.cuda.get_device_name() if gpu else "none (built only)"
    (out / "probe.json").write_text(json.dumps({"device": dev_name, "target": str(target), "rows": rows}, indent=1))
    lines = [f"device: {dev_name}; target: {target}", "",
             "| shape MxNxK | config | us | TFLOP/s | rel_l2 | cp.async | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['config']} | {r.get('us', '')} | {r.get('tflops', '')} | "
                     f"{r.get('rel_l2', '')} | {r.get('cp_async', '')} | {r.get('error', '')} |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
