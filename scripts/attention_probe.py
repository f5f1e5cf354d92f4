"""The fused attention kernel's schedule variants (`deploy/passes/attention_schedule.py`) on the
attention of ViT-S/16 and BERT: each built as the package builds it, checked against PyTorch in fp32,
and timed with TVM's time_evaluator, beside torch's scaled_dot_product_attention (its flash kernels).
Needs a GPU; `--build-only` builds every variant for sm_90 without one and reports ptxas's registers.

    python scripts/attention_probe.py --out DIR [--build-only] [--cases NAME,...]

The variants: `4 warps` is the package's schedule (a block of 64 query rows, a warp per 16 rows);
`8 warps` gives each 16 rows two warps, the GEMMs' columns split between them, the keys padded to 32;
`16 warps` four, the keys padded to 64 (more padding, fewer registers a thread). Nsight Compute found the
4-warp kernel at 2 warps a scheduler (results/h200/2026-12-05/).
Writes DIR/probe.json and DIR/probe.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

CASES = {  # name: (batch, heads, query rows, keys, head dimension), as the corpus's models at full size
    "ViT-S/16 b32": (32, 6, 197, 197, 64),
    "BERT b32 seq128": (32, 4, 128, 128, 64),
    "BERT b32 seq64": (32, 4, 64, 64, 64),
    "ViT-S/16 b1": (1, 6, 197, 197, 64),
}
VARIANTS = {"4 warps": (1, 16), "8 warps": (2, 32), "16 warps": (4, 64)}  # name: (col_warps, key padding)


def kernel(shape, col_warps: int, key_align: int):
    """The fused attention PrimFunc of q, k, v [B, H, n, d] (fp16; K read
    transposed as a model's K^T), scheduled: softmax(Q K^T) V written
    [B, n, H, d]."""
    from deploy.passes import attention, attention_schedule
    from deploy.tvm_compat import te

    b, h, s, k, d = shape
    q = te.placeholder((b, h, s, d), "float16", name="q")
    kk = te.placeholder((b, h, k, d), "float16", name="k")
    v = te.placeholder((b, h, k, d), "float16", name="v")
    kt = te.compute((b, h, d, k), lambda n, m, c, j: kk[n, m, j, c], name="kt")
    out = attention.attention_te(q, kt, v, out_bshd=True, key_align=key_align)
    func = te.create_prim_func([q, kk, v, out]).with_attr(
        attention.ATTR, {"q_rows": s, "keys": k, "head_dim": d, "tokens_first": True})
    return attention_schedule.schedule(func, col_warps=col_warps).mod["main"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--build-only", action="store_true", help="build for sm_90 only (no GPU needed)")
    p.add_argument("--cases", default=",".join(CASES), help="comma list of: " + ", ".join(CASES))
    args = p.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        print(f"error: unknown case {unknown[0]!r} | expected one of: {', '.join(CASES)}", file=sys.stderr)
        return 2

    import numpy as np

    from deploy import targets
    from deploy.build import build_kernel

    info = targets.resolve("cuda:sm_90" if args.build_only else "cuda")
    rows = []
    for name in names:
        shape = CASES[name]
        b, h, s, k, d = shape
        flop = 4.0 * b * h * s * k * d
        ref = host = None
        if not args.build_only:
            import torch

            rng = np.random.default_rng(0)
            host = [rng.standard_normal(sh).astype("float16") for sh in ((b, h, s, d), (b, h, k, d), (b, h, k, d))]
            t = [torch.from_numpy(a).cuda() for a in host]
            ref = torch.softmax(t[0].float() @ t[1].float().transpose(-1, -2), -1) @ t[2].float()
            ref = ref.permute(0, 2, 1, 3).cpu().numpy()
            sdpa = probe_common.cuda_event_us(
                lambda t=t: torch.nn.functional.scaled_dot_product_attention(*t, scale=1.0))
            rows.append(probe_common.timed_row(name, "torch sdpa", sdpa, flop))
        for label, (col_warps, align) in VARIANTS.items():
            row = {"shape": name, "config": label}
            try:
                lib = build_kernel("main", kernel(shape, col_warps, align), info)
                row["ptxas"] = probe_common.nvcc_usage(lib.imports[0].inspect_source(), "attention", "sm_90")
                if not args.build_only:
                    row.update(probe_common.run_and_time(lib, host, (b, s, h, d), "float16", ref, flop))
            except Exception as e:  # noqa: BLE001 - a probe records what fails and goes on
                row["error"] = probe_common.error_line(e)
            rows.append(row)
            print(row, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probe_common.write_results(out, "# Fused attention schedule variants", {"target": str(info.arch)}, rows,
                               "ptxas", shape_column="attention (B, H, rows, keys, d in the script)")
    return probe_common.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
