"""Fused attention against the unfused graph on the models of a Hugging Face sweep (scripts/hf_sweep.py):
each model optimized for sm_90 in fp16 with and without `fused_attention`, both compiled for llvm (the
kernels unscheduled: TVM lowers the fused kernel's computation as written) and run on the same seeded
inputs. A rewrite that changes what the graph computes shows as a rel. L2 above 0. No GPU needed.

    python scripts/fusion_check.py --sweep-work W --out DIR [--models A,B]

W is the sweep's --work folder (its `<model>-cuda_sm_90/export/manifest.json` name each model's ONNX file
and inputs). Writes DIR/fusion.json and DIR/fusion.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def check(manifest: dict, work: Path) -> dict:
    import numpy as np

    from deploy import targets
    from deploy.errors import error_line
    from deploy.passes import attention
    from tests.passes.test_attention import _kernels, _optimized, _run_on_cpu

    sm90 = targets.resolve("cuda:sm_90")
    try:
        outs, fused_kernels = {}, 0
        for fused in (False, True):
            mod = _optimized(manifest["origin"]["path"], sm90, work / str(fused), fused, inputs=manifest["inputs"])
            if fused:
                fused_kernels = sum(1 for f in _kernels(mod).values() if attention.is_attention(f))
                if not fused_kernels:
                    return {"fused_kernels": 0, "rel_l2": None}
            outs[fused] = _run_on_cpu(mod)
        rel = max(float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), 1e-12))
                  for a, b in zip(outs[False], outs[True]))
        return {"fused_kernels": fused_kernels, "rel_l2": rel}
    except Exception as e:  # noqa: BLE001 - the outcome is the answer
        return {"error": error_line(e)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep-work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="")
    args = p.parse_args(argv)
    wanted = {m.strip() for m in args.models.split(",") if m.strip()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for folder in sorted(Path(args.sweep_work).glob("*-cuda_sm_90")):
        name = folder.name.removesuffix("-cuda_sm_90")
        if wanted and name not in wanted:
            continue
        manifest = json.loads((folder / "export" / "manifest.json").read_text())
        rows[name] = check(manifest, out / "work" / name)
        print(name, rows[name], flush=True)
        (out / "fusion.json").write_text(json.dumps(rows, indent=1))
    lines = ["# Fused attention against the unfused graph (llvm, kernels unscheduled)", "",
             "| model | fused kernels | rel. L2 fused vs unfused |", "|---|---|---|"]
    for name, r in rows.items():
        res = r.get("error") or ("-" if r["rel_l2"] is None else f"{r['rel_l2']:.1e}")
        lines.append(f"| {name} | {r.get('fused_kernels', '-')} | {res.replace('|', '/')} |")
    (out / "fusion.md").write_text("\n".join(lines) + "\n")
    bad = [n for n, r in rows.items() if "error" in r or (r["rel_l2"] or 0) > 0]
    print(f"{len(rows) - len(bad)} of {len(rows)} as the graph computes" + (f"; not: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
