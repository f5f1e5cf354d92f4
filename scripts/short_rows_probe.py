"""Our warp-a-row schedule (`deploy/passes/gpu_rows.py`) against DLight's
GeneralReduction, which took these kernels before, on the normalizations of
ConvNeXt-T and ViT-S/16 at batch 32 (fp16): each kernel built both ways,
checked against the other, and timed with TVM's time_evaluator. Needs a GPU.

    python scripts/short_rows_probe.py --out DIR

Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

CASES = {  # name: (kind, shape)
    "ConvNeXt-T stage 1 LayerNorm": ("ln", (32, 56, 56, 96)),
    "ConvNeXt-T stage 2 LayerNorm": ("ln", (32, 28, 28, 192)),
    "ViT-S/16 LayerNorm": ("ln", (32, 197, 384)),
    "ViT-S/16 attention softmax": ("softmax", (32, 6, 197, 197)),
}


def _kernel(kind, shape, target):
    import numpy as np

    from deploy.tvm_compat import relax

    def build(x):
        if kind != "ln":
            return relax.op.nn.softmax(x, axis=-1)
        rng = np.random.default_rng(3)
        g = relax.const(rng.standard_normal(shape[-1]).astype("float16"))
        b = relax.const(rng.standard_normal(shape[-1]).astype("float16"))
        return relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-6)

    return probe_common.fused_kernel(build, shape, "float16", target)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import numpy as np

    from deploy import targets
    from deploy.passes.gpu_rows import ShortRows
    from deploy.tvm_compat import dlight, tvm

    info = targets.resolve("cuda")
    target = info.tvm_target()
    rows = []
    for name, (kind, shape) in CASES.items():
        func = _kernel(kind, shape, target)
        with target:
            ours = ShortRows().apply(func, target)
            theirs = dlight.ApplyDefaultSchedule(dlight.gpu.GeneralReduction())(tvm.IRModule({"main": func}))
        _, outs, us = probe_common.run_schedules(
            func, {"general_reduction": theirs["main"], "short_rows": ours.mod["main"]}, info)
        row = {"kernel": name, "shape": "x".join(map(str, shape)),
               **{label + "_us": t for label, t in us.items()}}
        outs = {label: o.astype("float32") for label, o in outs.items()}
        row["max_abs_diff"] = float(np.max(np.abs(outs["short_rows"] - outs["general_reduction"])))
        row["speedup"] = round(row["general_reduction_us"] / row["short_rows_us"], 2)
        nbytes = 2 * 2 * int(np.prod(shape))  # read once, written once, fp16
        row["short_rows_GBps"] = round(nbytes / row["short_rows_us"] / 1e3, 1)
        rows.append(row)
        print(row, flush=True)
    table = ["| kernel | shape | GeneralReduction us | ShortRows us | speed-up | ShortRows GB/s (one read, one write) "
             "| max abs diff |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['kernel']} | {r['shape']} | {r['general_reduction_us']} | {r['short_rows_us']} | {r['speedup']}x "
              f"| {r['short_rows_GBps']} | {r['max_abs_diff']:.3g} |" for r in rows]
    probe_common.write_kernel_probe(Path(args.out), rows, "each kernel's median of 5 x 100 runs (time_evaluator)",
                                    table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
