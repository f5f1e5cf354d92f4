"""How fast can a tensor-core GEMM that TVM 0.27 generates run, written by hand
instead of drawn by MetaSchedule's rules? Builds fp16 GEMMs (fp32
accumulation) under deploy/passes/mma_gemm.py's `mma.sync` schedule
(m16n8k16 through TVM's 16x16x16 intrinsics, operands staged in dynamic
shared memory by 16-byte copies, `ldmatrix` into registers, and a software
pipeline over the K tiles: `cp.async`, unless `--no-async`), built as the
package builds them (our TIR pipeline), in configurations beyond the
tuner's: a two-stage pipeline, and any of `mma_gemm.name_of`'s form, e.g.
`128x128x32-w2x2-s3-b3-f0` (compiled for 3 blocks per SM, fragments not
double-buffered). `--epilogue` adds a model's epilogue (`gemm_func`). On a
GPU it checks the result against PyTorch and times both (TVM's
time_evaluator; torch, i.e. cuBLAS (+ its GELU kernel), with CUDA events);
without one it only builds (`--target cuda:sm_90`), to see what lowers.

    python scripts/mma_gemm_probe.py --shapes 4096x4096x4096,6400x1536x384 --out DIR
    python scripts/mma_gemm_probe.py --epilogue gelu --shapes 6272x1536x384 --configs 128x128x32-w2x2-s4 --out DIR

Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

from deploy.passes import mma_gemm  # noqa: E402 - after the path (no TVM import at this point)

# The tuner's configurations (deploy/passes/mma_gemm.py), and a two-stage
# pipeline it leaves out: (block rows, block cols, warps along rows, warps
# along cols, K tile, stages)
CONFIGS = {"128x128x32-w2x2-s2": (128, 128, 2, 2, 32, 2), **mma_gemm.CONFIGS}


EPILOGUES = ("none", "bias", "gelu", "gelu-mul", "gelu-f32")


def gemm_func(m: int, n: int, k: int, epilogue: str = "none"):
    """C = A @ B in fp32 of fp16 operands, then the epilogue: `none` (C is
    the output), `bias` (fp16(C) + bias: a model's dense layer), `gelu`
    (then GELU as exported: x * (1 + erf(x / sqrt 2)) * 0.5, in fp16, as
    ViT's and ConvNeXt's fc1), `gelu-mul` (x * (1 / sqrt 2) instead of the
    division), `gelu-f32` (the same GELU computed in fp32 on C + bias, cast
    to fp16 once at the end)."""
    from tvm import te, tirx

    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((k, n), "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * b[r, j].astype("float32"), axis=r),
                   name="C")
    if epilogue == "none":
        return te.create_prim_func([a, b, c])
    bias = te.placeholder((n,), "float16", name="bias")
    if epilogue == "gelu-f32":
        h = te.compute((m, n), lambda i, j: c[i, j] + bias[j].astype("float32"), name="H")
        out = te.compute((m, n), lambda i, j: (h[i, j] * (te.erf(h[i, j] * tirx.const(0.7071067811865476, "float32"))
                                                          + tirx.const(1, "float32"))
                                               * tirx.const(0.5, "float32")).astype("float16"), name="D")
        return te.create_prim_func([a, b, bias, out])
    h = te.compute((m, n), lambda i, j: c[i, j].astype("float16") + bias[j], name="H")
    if epilogue == "bias":
        return te.create_prim_func([a, b, bias, h])
    half = "float16"
    if epilogue == "gelu":
        s = te.compute((m, n), lambda i, j: h[i, j] / tirx.const(1.4142135623730951, half), name="S")
    else:
        s = te.compute((m, n), lambda i, j: h[i, j] * tirx.const(0.7071067811865476, half), name="S")
    e = te.compute((m, n), lambda i, j: te.erf(s[i, j]) + tirx.const(1, half), name="E")
    g = te.compute((m, n), lambda i, j: h[i, j] * e[i, j], name="G")
    out = te.compute((m, n), lambda i, j: g[i, j] * tirx.const(0.5, half), name="D")
    return te.create_prim_func([a, b, bias, out])


def schedule(func, m: int, n: int, k: int, bm: int, bn: int, wm: int, wn: int, bk: int, stages: int, *knobs):
    """deploy/passes/mma_gemm.py's schedule under this configuration. Raises
    when the shape does not tile (M % bm, N % bn, K % bk)."""
    if m % bm or n % bn or k % bk:
        raise ValueError(f"{m}x{n}x{k} does not tile by {bm}x{bn}x{bk}")
    return mma_gemm.schedule(func, mma_gemm.match(func), (bm, bn, wm, wn, bk, stages, *knobs))


def build(m: int, n: int, k: int, config: tuple, epilogue: str, target, no_async: bool):
    """One configuration's kernel, built as the package builds it (our TIR
    pipeline, which turns cp.async on), or without cp.async."""
    import tvm

    from deploy.passes import tensor_core_smem

    sch = schedule(gemm_func(m, n, k, epilogue), m, n, k, *config)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    with tvm.transform.PassContext(opt_level=3):
        if no_async:
            return tvm.compile(mod, target=target)
        return tvm.compile(mod, target=target, tir_pipeline=tensor_core_smem.register())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x4096x4096,6400x1536x384,6400x384x1536,6400x1152x384")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="names in CONFIGS, or any of mma_gemm.name_of's form (e.g. 128x128x32-w2x2-s4-b3-f0)")
    p.add_argument("--epilogue", default="none", choices=EPILOGUES, help="see gemm_func")
    p.add_argument("--target", default=None, help="default: cuda on a GPU, else cuda:sm_90")
    p.add_argument("--no-async", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    shapes = probe_common.parse_shapes(args.shapes)
    if shapes is None:
        return 2
    configs = {}
    for name in args.configs.split(","):
        try:
            configs[name] = CONFIGS[name] if name in CONFIGS else mma_gemm.config_from_name(name)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

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
    for m, n, k in shapes:
        shape = f"{m}x{n}x{k}"
        flop = 2.0 * m * n * k
        run_args = None  # (on the GPU: run_and_time's arguments)
        if gpu:
            rng = np.random.default_rng(0)
            a_np = (rng.standard_normal((m, k)) / 8).astype("float16")
            b_np = (rng.standard_normal((k, n)) / 8).astype("float16")
            bias_np = (rng.standard_normal(n) / 8).astype("float16")
            ta, tb, tbias = (torch.from_numpy(x).cuda() for x in (a_np, b_np, bias_np))
            ref = ta.float() @ tb.float()
            if args.epilogue != "none":
                ref = ref.half() + tbias
            if args.epilogue.startswith("gelu"):
                ref = torch.nn.functional.gelu(ref.float())
            ref = ref.float().cpu().numpy()

            def cublas(ta=ta, tb=tb, tbias=tbias):  # (with the GELU as a second kernel)
                if args.epilogue == "none":
                    return torch.matmul(ta, tb)
                out = torch.addmm(tbias, ta, tb)
                return torch.nn.functional.gelu(out) if args.epilogue.startswith("gelu") else out

            rows.append(probe_common.torch_row(shape, "torch (cuBLAS)", cublas, flop))
            out_dtype = "float32" if args.epilogue == "none" else "float16"
            ins = [a_np, b_np] if args.epilogue == "none" else [a_np, b_np, bias_np]
            run_args = (ins, (m, n), out_dtype, ref, flop)
        for name, config in configs.items():
            rows.append(probe_common.measure(
                {"shape": shape, "config": name + ("" if args.no_async else "-async")},
                functools.partial(build, m, n, k, config, args.epilogue, target, args.no_async),
                {"cp_async": "cp.async", "ldmatrix": "ldmatrix", "mma": "mma.sync"},
                run_args, "sm_90"))
    dev_name = torch.cuda.get_device_name() if gpu else "none (built only)"
    probe_common.write_results(
        out, f"device: {dev_name}; target: {target}; epilogue: {args.epilogue} (scripts/mma_gemm_probe.py)",
        {"device": dev_name, "target": str(target), "epilogue": args.epilogue}, rows,
        "cp_async" if gpu else "ptxas")
    return probe_common.exit_code(rows)


if __name__ == "__main__":
    raise SystemExit(main())
