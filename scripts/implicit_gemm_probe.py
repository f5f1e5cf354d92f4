"""Convolutions as implicit GEMMs on our `mma.sync` schedule, against cuDNN.

Each convolution (NHWC data, OHWI weights, fp16, fp32 accumulation, then
fp16 + bias: a model's convolution with its folded batch norm) is written
as deploy/passes/implicit_gemm.py writes it (an im2col producer block
feeding a [N*Ho*Wo, O] GEMM), scheduled by deploy/passes/mma_gemm.py in
each configuration that tiles it, and built as the package builds it (our
TIR pipeline: the im2col tiles are predicated 16-byte `cp.async` copies).
Rows that 128 does not divide are padded as the CUDA profile's pad_gemm
pads them (`--no-pad`: as they are). On a GPU each is checked against
torch's conv2d and timed beside it (cuDNN,
channels last, `cudnn.benchmark`: scripts/conv_vs_cudnn.py's `time_torch`);
without one it only builds, and reports nvcc's registers.

    python scripts/implicit_gemm_probe.py --out DIR       (ResNet-50's 3x3 convolutions at batch 64)
    python scripts/implicit_gemm_probe.py --convs 64x14x14x256-256-3-s1 --configs 128x128x32-w2x2-s4 --out DIR

A convolution is `NxHxWxC-O-K-sS` (square K x K kernel, stride S, padding
(K - 1) / 2). Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

from deploy.passes import mma_gemm  # noqa: E402 - after the path

# ResNet-50's 3x3 convolutions at batch 64 (torchvision's v1.5: the stride in the 3x3)
RESNET50_B64 = ("64x56x56x64-64-3-s1,64x56x56x128-128-3-s2,64x28x28x128-128-3-s1,64x28x28x256-256-3-s2,"
                "64x14x14x256-256-3-s1,64x14x14x512-512-3-s2,64x7x7x512-512-3-s1")


def parse_convs(text: str) -> list[dict] | None:
    """`NxHxWxC-O-K-sS,...` as dicts; None (after one line on stderr) where it is not that."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)x([1-9]\d*)x([1-9]\d*)-([1-9]\d*)-([1-9]\d*)-s([1-9]\d*)", part.strip())
        if not m:
            print(f"error: not a convolution: {part!r} | expected NxHxWxC-O-K-sS, e.g. 64x14x14x256-256-3-s1",
                  file=sys.stderr)
            return None
        n, h, w, c, o, k, s = (int(v) for v in m.groups())
        pad = (k - 1) // 2
        oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
        if min(h, w) + 2 * pad < k:
            print(f"error: the kernel is larger than the padded input: {part!r} | expected K <= H + 2 * ((K - 1) // 2)",
                  file=sys.stderr)
            return None
        out.append({"name": part.strip(), "batch": n, "height": h, "width": w, "in_channels": c, "out_channels": o,
                    "kernel": k, "stride": s, "padding": pad, "out_height": oh, "out_width": ow,
                    "gflop": 2.0 * n * oh * ow * o * k * k * c / 1e9})
    return out


def conv_func(p: dict):
    """The PrimFunc of one convolution + bias as the pass writes it."""
    from tvm import te

    from deploy.passes import implicit_gemm

    k, pad = p["kernel"], p["padding"]
    x = te.placeholder((p["batch"], p["height"], p["width"], p["in_channels"]), "float16", name="x")
    w2 = te.placeholder((p["out_channels"], k * k * p["in_channels"]), "float16", name="w")
    bias = te.placeholder((p["out_channels"],), "float16", name="bias")
    out_shape = (p["batch"], p["out_height"], p["out_width"], p["out_channels"])
    gemm = implicit_gemm.conv_as_gemm(x, w2, (k, k), (p["stride"],) * 2, (pad,) * 4, out_shape, "float32")
    y = te.compute(gemm.shape, lambda i, j: gemm[i, j].astype("float16") + bias[j], name="bias_add")
    return te.create_prim_func([x, w2, bias, y])


def kernel(p: dict, pad: bool):
    """The PrimFunc as the package has it: conv_func, its rows padded by
    pad_gemm where it pads them (with `pad`)."""
    from deploy.passes.pad_gemm import pad_prim_func

    func = conv_func(p)
    return (pad_prim_func(func) or func) if pad else func


def build(func, config: str, target):
    import tvm

    from deploy.passes import tensor_core_smem

    sch = mma_gemm.schedule(func, mma_gemm.match(func), config)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")})
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(mod, target=target, tir_pipeline=tensor_core_smem.register())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convs", default=RESNET50_B64)
    p.add_argument("--configs", default="", help="names in mma_gemm.CONFIGS (default: every one that tiles)")
    p.add_argument("--target", default=None, help="default: cuda on a GPU, else cuda:sm_90")
    p.add_argument("--no-pad", action="store_true", help="leave rows that 128 does not divide as they are")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out is not a folder: {out} | expected a folder (made if missing)", file=sys.stderr)
        return 2
    convs = parse_convs(args.convs)
    if convs is None:
        return 2
    wanted = [c for c in args.configs.split(",") if c]
    unknown = [c for c in wanted if c not in mma_gemm.CONFIGS]
    if unknown:
        print(f"error: unknown configuration(s) {', '.join(unknown)} | expected names in "
              f"deploy/passes/mma_gemm.py's CONFIGS", file=sys.stderr)
        return 2

    import conv_vs_cudnn  # noqa: E402 - scripts/conv_vs_cudnn.py (its torch timing)
    import numpy as np
    import tvm

    from deploy import targets

    gpu = tvm.cuda(0).exist
    try:
        target = targets.resolve(args.target or ("cuda" if gpu else "cuda:sm_90")).tvm_target()
    except Exception as e:  # noqa: BLE001 - a ConfigError or TVM's TargetError: one line
        print(f"error: --target {args.target}: {probe_common.error_line(e)}", file=sys.stderr)
        return 2
    torch, dev_name = None, "none (built only)"
    if gpu:
        import torch

        dev_name = torch.cuda.get_device_name()
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def save():  # after each convolution: a probe stopped half-way keeps what it measured
        probe_common.write_results(
            out, f"device: {dev_name}; target: {target}; fp16 convolution + bias as an implicit GEMM "
                 "(scripts/implicit_gemm_probe.py)",
            {"device": dev_name, "target": str(target), "padded": not args.no_pad}, rows,
            "predicated" if gpu else "ptxas", shape_column="convolution NxHxWxC-O-K-sS")

    for c in convs:
        flop = c["gflop"] * 1e9
        try:
            func = kernel(c, not args.no_pad)
            gemm = mma_gemm.match(func)
        except Exception as e:  # noqa: BLE001 - a probe records what fails
            rows.append({"shape": c["name"], "config": "none", "error": probe_common.error_line(e)})
            save()
            continue
        names = [n for n in mma_gemm.configs_for(gemm) if not wanted or n in wanted] if gemm else []
        if not names:
            why = ("no configuration tiles this GEMM" if gemm else
                   "our schedule does not take it (input channels a multiple of 8, output channels of 16)")
            rows.append({"shape": c["name"], "config": "none", "error": why})
            save()
            continue
        padded = f" (rows {gemm.m})" if gemm.m != c["batch"] * c["out_height"] * c["out_width"] else ""
        run_args = None
        if gpu:
            rng = np.random.default_rng(0)
            k, ci, co = c["kernel"], c["in_channels"], c["out_channels"]
            x = (rng.standard_normal((c["batch"], c["height"], c["width"], ci)) / 4).astype("float16")
            w = (rng.standard_normal((co, k, k, ci)) / np.sqrt(k * k * ci)).astype("float16")
            b = (rng.standard_normal(co) / 4).astype("float16")
            tx = torch.from_numpy(x).cuda().permute(0, 3, 1, 2).float()
            tw = torch.from_numpy(w).cuda().permute(0, 3, 1, 2).float()
            ref = torch.nn.functional.conv2d(tx, tw, torch.from_numpy(b).cuda().float(), stride=c["stride"],
                                             padding=c["padding"])
            ref = ref.permute(0, 2, 3, 1).reshape(-1, co).cpu().numpy()
            rows.append(probe_common.timed_row(c["name"], "torch (cuDNN)",
                                               conv_vs_cudnn.time_torch(c, "cuda", "float16", 100), flop))
            run_args = ([x, w.reshape(co, -1), b], (ref.shape[0], co), "float16", ref, flop)
        for name in names:
            rows.append(probe_common.measure({"shape": c["name"], "config": name + padded},
                                             functools.partial(build, func, name, target),
                                             {"cp_async": "cp.async", "predicated": "cp_async_legacy_pred"},
                                             run_args, "sm_90"))
        save()
    return probe_common.exit_code(rows)


if __name__ == "__main__":
    raise SystemExit(main())
