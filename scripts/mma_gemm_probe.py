"""How fast can a tensor-core GEMM that TVM 0.27 generates run, written by hand
instead of drawn by MetaSchedule's rules? Builds fp16 GEMMs (fp32
accumulation and output) under a fixed `mma.sync` schedule: m16n8k16
through TVM's 16x16x16 intrinsics, operands staged in dynamic shared memory
by 16-byte copies, `ldmatrix` into registers, and a software pipeline over
the K tiles (`cp.async`, unless `--no-async`). Each config is one block tile and
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

# (block rows, block cols, warps along rows, warps along cols, K tile, stages)
CONFIGS = {
    "128x128x32-w2x2-s2": (128, 128, 2, 2, 32, 2),
    "128x128x32-w2x2-s3": (128, 128, 2, 2, 32, 3),
    "128x128x32-w2x2-s4": (128, 128, 2, 2, 32, 4),
    "128x256x32-w2x4-s3": (128, 256, 2, 4, 32, 3),
    "256x128x32-w4x2-s3": (256, 128, 4, 2, 32, 3),
    "128x128x64-w2x2-s3": (128, 128, 2, 2, 64, 3),
    "64x128x32-w2x2-s4": (64, 128, 2, 2, 32, 4),
}


def gemm_func(m: int, n: int, k: int):
    from tvm import te

    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((k, n), "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                   name="C")
    return te.create_prim_func([a, b, c])


def schedule(func, m: int, n: int, k: int, bm: int, bn: int, wm: int, wn: int, bk: int, stages: int, use_async: bool):
    """The schedule; tile sizes in elements. Raises when the shape does not
    tile (M % bm, N % bn, K % bk)."""
    import tvm
    from tvm.s_tir.tensor_intrin import cuda as ci

    if m % bm or n % bn or k % bk:
        raise ValueError(f"{m}x{n}x{k} does not tile by {bm}x{bn}x{bk}")
    fm, fn = bm // 16 // wm, bn // 16 // wn  # 16x16 fragments per warp along rows, cols
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    block = sch.get_sblock("C")
    i, j, kk = sch.get_loops(block)
    i, i_tc = sch.split(i, [None, 16])
    j, j_tc = sch.split(j, [None, 16])
    kk, k_tc = sch.split(kk, [None, 16])
    sch.reorder(i, j, kk, i_tc, j_tc, k_tc)
    outer = sch.blockize(i_tc)
    i0, i2, i3 = sch.split(i, [None, wm, fm])
    j0, j2, j3 = sch.split(j, [None, wn, fn])
    k0, k1 = sch.split(kk, [None, bk // 16])
    sch.reorder(i0, j0, i2, j2, k0, k1, i3, j3)
    bx = sch.fuse(i0, j0)
    sch.bind(bx, "blockIdx.x")
    ty = sch.fuse(i2, j2)
    sch.bind(ty, "threadIdx.y")
    warps = wm * wn

    def to_shared(idx):
        blk = sch.cache_read(outer, idx, "shared.dyn")
        sch.compute_at(blk, k0)
        fused = sch.fuse(*sch.get_loops(blk)[-2:])
        _, f1, f2, f3 = sch.split(fused, [None, warps, 32, 8])
        sch.bind(f2, "threadIdx.x")
        sch.bind(f1, "threadIdx.y")
        sch.vectorize(f3)
        sch.storage_align(blk, 0, axis=-2, factor=32, offset=8)
        return blk

    a_sh = to_shared(0)
    b_sh = to_shared(1)
    a_w = sch.cache_read(outer, 0, "warp")
    b_w = sch.cache_read(outer, 1, "warp")
    sch.compute_at(a_w, k1)
    sch.compute_at(b_w, k1)
    c_w = sch.cache_write(outer, 0, "warp")
    sch.reverse_compute_at(c_w, ty)
    ii, jj = sch.get_loops(c_w)[-2:]
    io, ii = sch.split(ii, [None, 16])
    jo, ji = sch.split(jj, [None, 16])
    sch.reorder(io, jo, ii, ji)
    sch.decompose_reduction(outer, sch.get_loops(outer)[2])
    init = sch.get_sblock("C_init")

    def frag(blk, h, w):
        a, b = sch.get_loops(blk)[-2:]
        a0, a1 = sch.split(a, [None, h])
        b0, b1 = sch.split(b, [None, w])
        sch.reorder(a0, b0, a1, b1)
        return a1

    la = frag(a_w, 16, 16)
    lb = frag(b_w, 16, 16)

    def index_map(r, c):
        return (r // 16, c // 16, *ci.shared_16x16_to_ldmatrix_32x8_layout(r % 16, c % 16))

    sch.transform_layout(a_w, ("write", 0), index_map)
    sch.transform_layout(b_w, ("write", 0), index_map)
    sch.transform_layout(c_w, ("read", 0), index_map)
    sch.tensorize(la, ci.LDMATRIX_f16_A_DYN_INTRIN)
    sch.tensorize(lb, ci.LDMATRIX_f16_B_DYN_INTRIN)
    sch.tensorize(sch.get_loops(block)[-3], ci.MMA_f16f16f32_INTRIN)
    sch.tensorize(sch.get_loops(init)[-2], ci.MMA_fill_16x16_f32_INTRIN)
    sch.tensorize(sch.get_loops(c_w)[-2], ci.MMA_store_16x16_f32_global_INTRIN)
    if stages > 1:
        # k0's body once k1 is pipelined: the two shared copies, then k1's
        # prologue (the first fragments' ldmatrix), body and epilogue; the
        # prologue of the next tile is issued before this tile's epilogue
        sch.annotate(k0, "software_pipeline_stage", [0, 0, stages - 2, stages - 1, stages - 1])
        sch.annotate(k0, "software_pipeline_order", [0, 1, 3, 2, 4])
        if use_async:
            sch.annotate(k0, "software_pipeline_async_stages", [0])
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
    del a_sh, b_sh
    return sch


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
                sch = schedule(gemm_func(m, n, k), m, n, k, bm, bn, wm, wn, bk, st, not args.no_async)
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
