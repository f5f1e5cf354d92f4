"""Our schedules of movement (`deploy/passes/gpu_movement.py`: ShortInnerAxis,
TiledTranspose, VectorRows) against DLight's Fallback, which took these kernels before,
on the corpus's transposes, resizes, casts and concatenations: each kernel built both ways, checked against the
other (bit for bit: both only move and cast), and timed with TVM's
time_evaluator. Needs a GPU.

    python scripts/movement_probe.py --out DIR

Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file


def _nhwc(x, pad=0):
    from deploy.tvm_compat import relax

    y = relax.op.astype(relax.op.permute_dims(x, [0, 2, 3, 1]), "float16")
    return relax.op.nn.pad(y, [0, 0, 0, 0, 0, 0, 0, pad]) if pad else y


def _cases():
    from deploy.tvm_compat import relax

    perm = relax.op.permute_dims
    return {  # name: (rule, build, input shape, input dtype[, more inputs' shapes])
        "ResNet-50 b64 input, NCHW fp32 -> NHWC fp16 padded to 8": ("short", lambda x: _nhwc(x, 5),
                                                                    (64, 3, 224, 224), "float32"),
        "ResNet-50 b1 input, NCHW fp32 -> NHWC fp16": ("short", _nhwc, (1, 3, 224, 224), "float32"),
        "ShuffleNet-V2 b32 channels made NHWC": ("tiled", lambda x: perm(x, [0, 2, 3, 1]), (32, 116, 28, 28),
                                                 "float16"),
        "UNet b32 features made NCHW": ("tiled", lambda x: perm(x, [0, 3, 1, 2]), (32, 128, 128, 64), "float16"),
        "Swin-T b32 keys transposed": ("tiled", lambda x: perm(x, [0, 1, 3, 2]), (2048, 3, 49, 32), "float16"),
        "UNet b32 upsampling, nearest x2 (NHWC)": ("vector", lambda x: relax.op.image.resize2d(
            x, (256, 256), layout="NHWC", method="nearest_neighbor", coordinate_transformation_mode="asymmetric",
            rounding_method="floor"), (32, 128, 128, 64), "float16"),
        "NHWC features padded by a pixel": ("vector", lambda x: relax.op.nn.pad(x, [0, 0, 1, 1, 1, 1, 0, 0]),
                                            (32, 56, 56, 64), "float16"),
        "NHWC features cast fp32 -> fp16": ("vector", lambda x: relax.op.astype(x, "float16"), (32, 56, 56, 64),
                                            "float32"),
        # (more inputs: their shapes after the dtype)
        "UNet b32 skip concatenation, 32 + 32 channels": ("vector", lambda *xs: relax.op.concat(list(xs), axis=3),
                                                         (32, 256, 256, 32), "float16", [(32, 256, 256, 32)]),
        "DenseNet b32 concatenation, 128 + 3 x 32 channels": ("vector", lambda *xs: relax.op.concat(list(xs), axis=3),
                                                              (32, 28, 28, 128), "float16", [(32, 28, 28, 32)] * 3),
    }


RULES = {"short": "ShortInnerAxis", "tiled": "TiledTranspose", "vector": "VectorRows"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import numpy as np

    from deploy import targets
    from deploy.passes import gpu_movement
    from deploy.tvm_compat import dlight, tvm

    info = targets.resolve("cuda")
    target = info.tvm_target()
    rows = []
    for name, (rule, build, shape, dtype, *more) in _cases().items():
        func = probe_common.fused_kernel(build, shape, dtype, target, *more)
        with target:
            ours = getattr(gpu_movement, RULES[rule])().apply(func, target)
            theirs = dlight.ApplyDefaultSchedule(dlight.gpu.Fallback())(tvm.IRModule({"main": func}))
        row = {"kernel": name, "rule": rule, "shape": "x".join(map(str, shape))}
        if ours is None:
            row["error"] = "our rule declined the kernel"
        else:
            host, outs, us = probe_common.run_schedules(func, {"fallback": theirs["main"], "ours": ours.mod["main"]},
                                                        info)
            nbytes = sum(a.nbytes for a in host)  # the inputs read once, the output written once
            row["MB"] = round(nbytes / 1e6, 1)
            for label, t in us.items():
                row[label + "_us"], row[label + "_GBps"] = t, round(nbytes / t / 1e3, 1)
            row["equal"] = bool(np.array_equal(outs["ours"], outs["fallback"]))
            row["speedup"] = round(us["fallback"] / us["ours"], 2)
        rows.append(row)
        print(row, flush=True)
    table = ["| kernel | shape | MB | Fallback us | ours us | speed-up | Fallback GB/s | ours GB/s | equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['kernel']} | {r['shape']} | {r.get('MB', '')} | {r.get('fallback_us', '')} | {r.get('ours_us', '')} "
              f"| {r.get('speedup', '')}x | {r.get('fallback_GBps', '')} | {r.get('ours_GBps', '')} "
              f"| {r.get('equal', r.get('error', ''))} |" for r in rows]
    probe_common.write_kernel_probe(Path(args.out), rows, "each kernel's median of 5 x 100 runs (time_evaluator); "
                                    "GB/s: its input read once and its output written once", table)
    return 0 if all(r.get("equal") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
