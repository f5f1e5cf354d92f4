"""Can TVM 0.27 generate a Hopper GEMM (`wgmma` fed by TMA) that closes the
gap to cuBLAS which our `mma.sync` schedule leaves (passes/mma_gemm.py: 33.0
against cuBLAS's 20.4 us on 6272x1536x384, results/h200/2026-12-04/mma-gemm-variants/)?

MetaSchedule, DLight and the s_tir intrinsics stop at `mma.sync`; TVM 0.27's
TIRx language reaches Hopper's instructions directly (`T.ptx[...]`, `T.cuda.wgmma`),
without a tile primitive for them. This is such a kernel, written in TIRx:
C[M, N] fp16 = epilogue(A[M, K] @ B[N, K]^T + bias[N]), fp32 accumulation.

- One warpgroup (128 threads) a CTA computes a 128 x BN tile as two
  `wgmma.mma_async m64nBNk16` (both operands K-major in shared memory).
- A and B tiles of 64 columns arrive by TMA (`cp.async.bulk.tensor`, 128-byte
  swizzle) into a STAGES-deep ring of dynamic shared memory, each stage an
  mbarrier; the host stub encodes the tensor maps on every call
  (`runtime.cuTensorMapEncodeTiled`).
- The epilogue (bias; `--epilogue gelu`: GELU in fp32 with erf) is applied to
  the accumulators in registers and written to global memory as fp16.
- N % BN must be 0, BN a multiple of 8 up to 256 (at 256 ptxas spills:
  255 registers), K a multiple of one
  wgmma's 16 (fp16) or 8 (tf32). Neither M nor K need fill the tiles: TMA
  reads the rows past M and the columns past K as zeros (a stage holds 64
  fp16 or 32 fp32 columns), and rows past M are not written.
- `--dtype tf32`: fp32 operands, bias and output, the products on TF32 tensor
  cores (`wgmma ... k8 .tf32`; issue 19's TF32 option), checked against
  strict fp32 and timed beside cuBLAS with `allow_tf32`.

`--kernels persistent` (`make_gemm_ws`, fp16) is the same GEMM the way
cuBLAS's Hopper kernels are built: warp-specialized (a producer warpgroup
issues the TMA loads, two consumer warpgroups multiply, `full` and `empty`
mbarriers a stage) on a persistent grid (a CTA an SM takes tiles in turn,
the ring running on across them), each thread's two adjacent outputs one
`half2` store at first (results/h100/2026-12-05/wgmma-ws-probe/: 640
TFLOP/s at 4096^3, and faster than our `mma.sync` schedule on the models'
short-K GEMMs, which `single` is not); `--store staged` (the default) puts
the result through shared memory, 16-byte loads and stores a thread
(passes/wgmma_epilogue.py), `--store registers` is the first; `--epilogue
residual` is ResNet's (bias, an fp16 residual, ReLU).

It is built with TVM's `tirx` TIR pipeline for `sm_90a` (`wgmma` needs the
`a` target). On a GPU the probe checks the result against PyTorch and times
it (TVM's time_evaluator) beside cuBLAS (`torch.addmm`, plus a GELU kernel);
without one it builds, compiles the CUDA source with nvcc and reports the
registers and spills.

    python scripts/wgmma_gemm_probe.py --shapes 6272x1536x384,6400x384x1536 --epilogue gelu --out DIR
    python scripts/wgmma_gemm_probe.py --kernels persistent --bn 128,256 --shapes 4096x4096x4096 --out DIR
    python scripts/wgmma_gemm_probe.py --kernels persistent --b-layout kn --shapes 6272x1536x384 --out DIR
    python scripts/wgmma_gemm_probe.py --kernels persistent --in-flight 0,1 --shapes 6272x1536x384 --out DIR
    python scripts/wgmma_gemm_probe.py --kernels persistent --b-layout kn --epilogue residual \
        --store staged,registers --shapes 200704x256x64 --out DIR
    python scripts/wgmma_gemm_probe.py --kernels persistent --pingpong 0,1 --shapes 100352x384x96 --out DIR

Writes DIR/probe.json and DIR/probe.md.

Both kernels need the workaround of TVM 0.27's `noop_barrier` codegen that
deploy/passes/wgmma_gemm.py describes (`fix_noop_barrier_codegen`);
`tests/test_wgmma_probe.py` fails once TVM no longer needs it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

from deploy.passes import wgmma_gemm  # noqa: E402 - after the path (no TVM import at this point)

# (the pass's: its TMA load, a CTA's rows (two m64 wgmmas), the shared memory a block may take, its target)
TMA_LOAD, BM, SHARED_MEMORY, target = wgmma_gemm.TMA_LOAD, wgmma_gemm.BM, wgmma_gemm.SHARED_MEMORY, wgmma_gemm.target
SWIZZLE_BYTES = 128  # a stage's K extent in bytes: the TMA swizzle's width (64 fp16 or 32 fp32 columns)
EPILOGUES = ("bias", "gelu", "residual")  # (residual: ResNet's, the persistent kernel only)
STORES = ("staged", "registers")  # the persistent kernel's epilogue (passes/wgmma_epilogue.py)
KERNELS = {"single": "wgmma", "persistent": "wgmma-ws"}  # --kernels: the name its rows carry
# dtype: (element type in memory, bytes, wgmma's K per instruction, its input type, its transpose immediates)
DTYPES = {"fp16": ("float16", 2, 16, "f16", (0, 0)), "tf32": ("float32", 4, 8, "tf32", ())}


def make_gemm(m: int, n: int, k: int, bn: int = 128, stages: int = 4, epilogue: str = "bias",
              dtype: str = "fp16"):
    """The kernel as a PrimFunc (global symbol `main`). `dtype` fp16: fp16
    operands, bias and output; tf32: fp32 operands, bias and output, the
    products on TF32 tensor cores (what PyTorch's matmul does with
    `allow_tf32`)."""
    from tvm.script import tirx as T

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: one of {', '.join(DTYPES)}")
    elem, ebytes, kstep, wtype, trans = DTYPES[dtype]
    bk = SWIZZLE_BYTES // ebytes
    if n % bn or bn % 8 or not 8 <= bn <= 256 or k % kstep:
        raise ValueError(f"{m}x{n}x{k} does not tile by {BM}x{bn}x{kstep} (N % {bn}, K % {kstep}; "
                         f"the tile's columns a multiple of 8 up to 256)")
    smem = stages * (BM + bn) * SWIZZLE_BYTES
    if smem > SHARED_MEMORY:
        raise ValueError(f"{stages} stages of 128x{bn} tiles need {smem // 1024} KB of shared memory; "
                         f"a block has {SHARED_MEMORY // 1024} KB on sm_90")
    if epilogue not in EPILOGUES[:2]:
        raise ValueError(f"unknown epilogue {epilogue!r}: one of {', '.join(EPILOGUES[:2])}")
    gelu = epilogue == "gelu"
    # (rows past M and columns past K: TMA reads zeros, which add nothing)
    k_tiles, grid_m, grid_n = (k + bk - 1) // bk, (m + BM - 1) // BM, n // bn
    a_tile, b_tile = BM * bk, bn * bk  # elements a stage holds
    stage_bytes = (a_tile + b_tile) * ebytes
    step_bytes = kstep * ebytes  # one wgmma's K extent: 32 bytes for either type
    nacc = bn // 2  # fp32 accumulators a thread holds for one m64 x bn wgmma
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k{kstep}.f32.{wtype}.{wtype}"
    prologue = min(stages, k_tiles)
    # cuTensorMapEncodeTiled: global dims (2), global stride (bytes), box (2), element strides (2),
    # interleave, swizzle (3: 128 bytes), L2 promotion, out-of-bounds fill
    a_map_args = [k, m, k * ebytes, bk, BM, 1, 1, 0, 3, 2, 0]
    b_map_args = [k, n, k * ebytes, bk, bn, 1, 1, 0, 3, 2, 0]

    def accs(acc, h):
        return [acc[h * nacc + i] for i in range(nacc)]

    # fmt: off
    @T.prim_func
    def gemm(a_ptr: T.handle, b_ptr: T.handle, bias_ptr: T.handle, c_ptr: T.handle):
        A = T.match_buffer(a_ptr, (m, k), elem, align=16)
        B = T.match_buffer(b_ptr, (n, k), elem, align=16)
        bias = T.match_buffer(bias_ptr, (n,), elem, align=16)
        C = T.match_buffer(c_ptr, (m, n), elem, align=16)
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", A_map, elem, 2, A.data, *a_map_args)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, elem, 2, B.data, *b_map_args)

        T.device_entry()
        bx = T.cta_id([grid_m * grid_n])
        tx = T.thread_id([128])
        arena = T.alloc_buffer((stages * (a_tile + b_tile),), elem, scope="shared.dyn", align=1024)
        A_s = T.decl_buffer((stages, BM, bk), elem, data=arena.data, scope="shared.dyn")
        B_s = T.decl_buffer((stages, bn, bk), elem, data=arena.data, elem_offset=stages * a_tile,
                            scope="shared.dyn")
        bars = T.alloc_shared((stages,), "uint64")
        acc = T.alloc_local((2 * nacc,), "float32")
        desc_a: T.uint64
        desc_b: T.uint64
        d_a: T.uint64
        d_b: T.uint64
        m0 = T.meta_var((bx // grid_n) * BM)
        n0 = T.meta_var((bx % grid_n) * bn)

        if tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(bars.ptr_to([s]), T.uint32(1))
        T.ptx.fence.proxy.async_.shared__cta()
        T.cuda.cta_sync()
        if tx == 0:  # the ring's first tiles
            for s in T.unroll(prologue):
                T.ptx[TMA_LOAD](A_s.ptr_to([s, 0, 0]), T.address_of(A_map), s * bk, m0, bars.ptr_to([s]))
                T.ptx[TMA_LOAD](B_s.ptr_to([s, 0, 0]), T.address_of(B_map), s * bk, n0, bars.ptr_to([s]))
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars.ptr_to([s]), T.uint32(stage_bytes))
        # descriptors of stage 0; a step's own offset is added in 16-byte units
        # (desc_a ... d_b: TVMScript's declared locals above, which ruff cannot see)
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a), A_s.ptr_to([0, 0, 0]), 1, 64, 3)  # noqa: F821
        T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b), B_s.ptr_to([0, 0, 0]), 1, 64, 3)  # noqa: F821
        for kt in T.serial(k_tiles):
            T.cuda.mbarrier_wait(bars.ptr_to([kt % stages]), (kt // stages) % 2)
            for i in T.unroll(2 * nacc):
                T.cuda.wgmma.noop_barrier(acc[i])
            T.ptx.wgmma.fence.sync.aligned()
            for kk in T.unroll(bk // kstep):
                d_b = desc_b + T.Cast("uint64", ((kt % stages) * b_tile * ebytes + kk * step_bytes) // 16)  # noqa: F821
                for h in T.unroll(2):
                    d_a = desc_a + T.Cast(  # noqa: F821
                        "uint64", ((kt % stages) * a_tile * ebytes + h * 64 * bk * ebytes + kk * step_bytes) // 16)
                    # scale-d false on the first step: the accumulators start at zero
                    T.ptx[mma](*accs(acc, h), d_a, d_b, kt * (bk // kstep) + kk > 0, 1, 1, *trans)
            T.ptx.wgmma.commit_group.sync.aligned()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            for i in T.unroll(2 * nacc):
                T.cuda.wgmma.noop_barrier(acc[i])
            if tx == 0 and kt + stages < k_tiles:  # this slot's wgmmas are done: refill it
                T.ptx[TMA_LOAD](A_s.ptr_to([kt % stages, 0, 0]), T.address_of(A_map), (kt + stages) * bk, m0,
                                bars.ptr_to([kt % stages]))
                T.ptx[TMA_LOAD](B_s.ptr_to([kt % stages, 0, 0]), T.address_of(B_map), (kt + stages) * bk, n0,
                                bars.ptr_to([kt % stages]))
                T.ptx.mbarrier.arrive.expect_tx.shared.b64(bars.ptr_to([kt % stages]), T.uint32(stage_bytes))
        # epilogue: the m64nN accumulator layout -> (+ bias, GELU) -> fp16
        for h in T.unroll(2):
            for i in T.unroll(nacc // 4):
                for r in T.unroll(2):
                    for c in T.unroll(2):
                        row = T.meta_var(m0 + h * 64 + (tx // 32) * 16 + (tx % 32) // 4 + r * 8)
                        col = T.meta_var(n0 + i * 8 + (tx % 4) * 2 + c)
                        x = T.meta_var(acc[h * nacc + i * 4 + r * 2 + c] + T.Cast("float32", bias[col]))
                        if row < m:
                            if gelu:
                                C[row, col] = T.Cast(elem, T.float32(0.5) * x
                                                     * (T.float32(1) + T.erf(x * T.float32(0.7071067811865476))))
                            else:
                                C[row, col] = T.Cast(elem, x)
    # fmt: on
    return gemm.with_attr("global_symbol", "main")


def make_gemm_ws(m: int, n: int, k: int, bn: int = 128, stages: int = 4, epilogue: str = "bias",
                 sms: int = 132, b_kn: bool = False, in_flight: int = 0, pingpong: bool = False,
                 store: str = "staged"):
    """`make_gemm`'s GEMM (fp16) as the package builds it with --wgmma-gemm
    (deploy/passes/wgmma_gemm.py): warp-specialized on a persistent grid, as
    cuBLAS's Hopper kernels are. `sms` CTAs take the 128 x bn tiles in turn;
    a producer warpgroup (one thread issuing TMA) keeps the ring full across
    tiles, two consumer warpgroups (64 rows each) multiply, and apply the
    epilogue while the producer loads the next tile. `b_kn`: B stored [K, N]
    (ONNX MatMul's weight) instead of [N, K]; `in_flight`: wgmma groups a
    consumer leaves running, `pingpong`: each consumer warpgroup whole
    tiles, the two in turn (the pass's `kernel`). N need not be a multiple
    of `bn` (the last tile's columns past N read as zeros, not written).
    The epilogue is made as the
    model's would be, a fused function's blocks (bias: fp16(C + bias); gelu:
    GELU of it in fp32; residual: ResNet's, relu(fp16(C) + bias + R) with R
    an fp16 [M, N] input), and carried into the kernel by the pass, which
    stores it as `store` says (staged through shared memory or as the
    registers hold it: the pass's `kernel`)."""
    from tvm import te, tirx

    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}: one of {', '.join(EPILOGUES)}")
    a = te.placeholder((m, k), "float16", name="A")
    b = te.placeholder((k, n) if b_kn else (n, k), "float16", name="B")
    bias = te.placeholder((n,), "float16", name="bias")
    r = te.reduce_axis((0, k), "r")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * (b[r, j] if b_kn else b[j, r]).astype("float32"), axis=r), name="C")
    if epilogue == "residual":
        res = te.placeholder((m, n), "float16", name="R")
        out = te.compute((m, n), lambda i, j: te.max(c[i, j].astype("float16") + bias[j] + res[i, j],
                                                     tirx.const(0, "float16")), name="D")
        tensors = [a, b, bias, res, out]
    else:
        h = te.compute((m, n), lambda i, j: c[i, j] + bias[j].astype("float32"), name="H")
        if epilogue == "gelu":
            h = te.compute((m, n), lambda i, j: tirx.const(0.5, "float32") * h[i, j] * (
                tirx.const(1, "float32") + te.erf(h[i, j] * tirx.const(0.7071067811865476, "float32"))), name="G")
        tensors = [a, b, bias, te.compute((m, n), lambda i, j: h[i, j].astype("float16"), name="D")]
    plan = wgmma_gemm.plan(te.create_prim_func(tensors))
    if plan is None:
        raise ValueError(f"{m}x{n}x{k}: not a GEMM the pass takes (M a multiple of 16, N and K of 8)")
    return wgmma_gemm.kernel(plan, stages=stages, sms=sms, bn=bn, in_flight=in_flight,
                             pingpong=pingpong, epilogue=store).with_attr("global_symbol", "main")


def build(func):
    from deploy.tvm_compat import tvm

    wgmma_gemm.fix_noop_barrier_codegen()
    return tvm.compile(tvm.IRModule({"main": func}), target=target(), tir_pipeline="tirx")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="6272x1536x384,6400x384x1536,4096x4096x4096", help="MxNxK,...")
    p.add_argument("--bn", default="128", help="tile columns to try, e.g. 64,128")
    p.add_argument("--stages", default="4", help="ring depths to try, e.g. 3,4")
    p.add_argument("--epilogue", default="bias", choices=EPILOGUES)
    p.add_argument("--dtype", default="fp16", choices=tuple(DTYPES),
                   help="tf32: fp32 operands on TF32 tensor cores, checked against strict fp32")
    p.add_argument("--kernels", default="single,persistent",
                   help="single: make_gemm; persistent: make_gemm_ws (warp-specialized, fp16 only)")
    p.add_argument("--in-flight", default="0",
                   help="wgmma groups a consumer leaves running, e.g. 0,1 (persistent kernel only)")
    p.add_argument("--pingpong", default="0",
                   help="0: the two consumer warpgroups share each tile; 1: each takes whole tiles in turn; "
                        "0,1 both (persistent kernel only)")
    p.add_argument("--store", default="staged",
                   help="the persistent kernel's epilogue: staged (through shared memory, 16-byte stores) or "
                        "registers (two columns a store); staged,registers both")
    p.add_argument("--b-layout", default="nk", choices=("nk", "kn"),
                   help="B stored [N, K] (a dense layer's weight) or [K, N] (ONNX MatMul's; persistent kernel only)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    shapes = probe_common.parse_shapes(args.shapes)
    bns, stage_list = probe_common.parse_ints(args.bn, "--bn"), probe_common.parse_ints(args.stages, "--stages")
    flights = probe_common.parse_ints(args.in_flight, "--in-flight", choices=(0, 1))
    pings = probe_common.parse_ints(args.pingpong, "--pingpong", choices=(0, 1))
    if shapes is None or bns is None or stage_list is None or flights is None or pings is None:
        return 2
    kernels = args.kernels.split(",")
    if not kernels or any(x not in KERNELS for x in kernels):
        print(f"error: unknown kernel in --kernels {args.kernels!r} | expected any of {', '.join(KERNELS)}",
              file=sys.stderr)
        return 2
    if args.dtype != "fp16" and "persistent" in kernels:
        if args.kernels != p.get_default("kernels"):
            print("error: the persistent kernel is fp16 only | use --kernels single with --dtype tf32",
                  file=sys.stderr)
            return 2
        kernels = ["single"]
    stores = args.store.split(",")
    if not stores or any(x not in STORES for x in stores):
        print(f"error: unknown epilogue in --store {args.store!r} | expected any of {', '.join(STORES)}",
              file=sys.stderr)
        return 2
    if args.epilogue == "residual" and kernels != ["persistent"]:
        print("error: --epilogue residual is the persistent kernel's only | add --kernels persistent", file=sys.stderr)
        return 2
    b_kn = args.b_layout == "kn"
    if b_kn and kernels != ["persistent"]:
        print("error: --b-layout kn is the persistent kernel's only | add --kernels persistent", file=sys.stderr)
        return 2

    import numpy as np

    from deploy.tvm_compat import tvm

    gpu = tvm.cuda(0).exist
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch = None
    if gpu:
        import torch
    rows = []
    elem, ebytes = DTYPES[args.dtype][:2]
    bk = SWIZZLE_BYTES // ebytes
    for m, n, k in shapes:
        shape = f"{m}x{n}x{k}"
        flop = 2.0 * m * n * k
        run_args = None  # (on the GPU: run_and_time's arguments)
        if gpu:
            rng = np.random.default_rng(0)
            a_np = (rng.standard_normal((m, k)) / 8).astype(elem)
            b_np = (rng.standard_normal((k, n) if b_kn else (n, k)) / 8).astype(elem)
            bias_np = (rng.standard_normal(n) / 8).astype(elem)
            r_np = (rng.standard_normal((m, n)) / 8).astype(elem)  # (the residual's: read where asked)
            ta, tb, tbias, tr = (torch.from_numpy(x).cuda() for x in (a_np, b_np, bias_np, r_np))
            torch.backends.cuda.matmul.allow_tf32 = False  # the reference: strict fp32
            tb_t = tb if b_kn else tb.T  # (B^T, as the product takes it)
            ref = ta.float() @ tb_t.float() + tbias.float()
            if args.epilogue == "residual":
                ref = torch.relu(ref + tr.float())
            ref = (torch.nn.functional.gelu(ref) if args.epilogue == "gelu" else ref).cpu().numpy()
            torch.backends.cuda.matmul.allow_tf32 = args.dtype == "tf32"  # cuBLAS on TF32 tensor cores

            def cublas(ta=ta, tb_t=tb_t, tbias=tbias, tr=tr):
                y = torch.addmm(tbias, ta, tb_t)
                if args.epilogue == "residual":
                    return torch.relu(y + tr)
                return torch.nn.functional.gelu(y) if args.epilogue == "gelu" else y

            rows.append(probe_common.torch_row(shape, f"torch (cuBLAS, {args.dtype})", cublas, flop))
            inputs = [a_np, b_np, bias_np] + ([r_np] if args.epilogue == "residual" else [])
            run_args = (inputs, (m, n), elem, ref, flop)
        configs = [(kernel, bn, stages, fl, pp, st) for kernel in kernels for bn in bns for stages in stage_list
                   for fl in (flights if kernel == "persistent" else [0])
                   for pp in (pings if kernel == "persistent" else [0])
                   for st in (stores if kernel == "persistent" else ["registers"])]
        for kernel, bn, stages, fl, pp, st in configs:
            make = (functools.partial(make_gemm, m, n, k, bn, stages, args.epilogue, args.dtype)
                    if kernel == "single" else functools.partial(make_gemm_ws, m, n, k, bn, stages,
                                                                 args.epilogue, b_kn=b_kn, in_flight=fl,
                                                                 pingpong=bool(pp), store=st))
            rows.append(probe_common.measure(
                {"shape": shape, "config": f"{KERNELS[kernel]} {args.dtype} 128x{bn}x{bk}-s{stages}"
                                           + ("-kn" if b_kn else "") + (f"-f{fl}" if fl else "")
                                           + ("-pp" if pp else "") + ("-reg" if st == "registers" and
                                                                      kernel == "persistent" else "")},
                lambda make=make: build(make()), {"wgmma": "wgmma.mma_async", "tma": "cp.async.bulk.tensor"},
                run_args, "sm_90a"))
    dev_name = torch.cuda.get_device_name() if gpu else "none (built only)"
    probe_common.write_results(
        out, f"device: {dev_name}; target sm_90a; {args.dtype}, epilogue {args.epilogue} (scripts/wgmma_gemm_probe.py)",
        {"device": dev_name, "dtype": args.dtype, "epilogue": args.epilogue}, rows, "ptxas")
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # (PyTorch's default, for a caller in this process)
    return probe_common.exit_code(rows)


if __name__ == "__main__":
    raise SystemExit(main())
