"""Which tuned kernel makes a bucket's outputs wrong.

A package that validates untuned and fails tuned has a tuned kernel that
computes something else. This builds the bucket once per tuned kernel, with
only that kernel's record applied (every other kernel from default
schedules), runs each build on the same seeded inputs and compares its
outputs with ONNX Runtime's: the kernels whose build alone is off are the
culprits. Needs the device (the target's GPU, or llvm here).

    python scripts/kernel_bisect.py --workdir WS --db DB_FOLDER --bucket 1-seq64 [--target cuda] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--db", required=True, help="the bucket's tuning database folder")
    p.add_argument("--bucket", required=True, help="bucket label, e.g. 1 or 1-seq64")
    p.add_argument("--target", default="auto")
    p.add_argument("--out", default="")
    args = p.parse_args()

    import onnxruntime as ort

    from deploy import build, config, export, optimize, shapes, targets
    from deploy.runtime import outputs_to_numpy, random_inputs
    from deploy.tuning import database as dbs
    from deploy.tvm_compat import VirtualMachine, load_module, tensor

    ws = Path(args.workdir)
    ex, opt = export.load(ws / "export"), optimize.load(ws / "optimize")
    bucket = shapes.parse(args.bucket)
    target = targets.resolve(args.target)
    table = dict(opt.manifest["profile"])
    profile = config.Profile(**{k: tuple(v) if isinstance(v, list) else v for k, v in table.items()})
    folder = Path(args.db)
    key = json.loads((folder / dbs.KEY_FILE).read_text())
    workloads, records = dbs._best_lines(folder, 1)
    specs = ex.bucket_inputs(bucket)
    inputs = random_inputs(ex.random_specs(bucket), bucket.batch, seed=0)
    ref = ort.InferenceSession(str(ex.onnx_path)).run(None, {i.name: a for i, a in zip(specs, inputs)})
    dev = target.device()

    def rel_l2(outs):
        return max(float(np.linalg.norm(o.astype("float64") - r) / max(np.linalg.norm(r), 1e-30))
                   for o, r in zip(outs, ref))

    def run_with(lines, tmp: Path, name: str) -> dict:
        real = dbs._best_lines
        dbs._best_lines = lambda f, k, slower_than_default=False: (workloads, lines)
        try:
            info, _ = build.build_bucket(str(opt.module_path(bucket)), target, profile, (str(folder), key),
                                         str(tmp / f"{name}.so"), None)
        finally:
            dbs._best_lines = real
        vm = VirtualMachine(load_module(str(tmp / f"{name}.so")), dev)
        outs = outputs_to_numpy(vm["main"](*[tensor(a, dev) for a in inputs]))
        return {"tuned_kernels": info["tuned_kernels"], "rel_l2": rel_l2(outs)}

    def describe(line: str) -> dict:
        wl = json.loads(workloads[json.loads(line)[0]])
        from deploy.tvm_compat import load_json

        try:
            import base64

            mod = load_json(base64.b64decode(wl[1]).decode()) if not wl[1].lstrip().startswith("{") else load_json(wl[1])
            func = next(iter(mod.functions.values()))
            shapes_ = [[int(d) for d in b.shape] for b in func.buffer_map.values()]
        except Exception as e:  # noqa: BLE001 - the hash alone still names it
            shapes_ = f"? ({type(e).__name__})"
        rec = json.loads(line)[1]  # [trace, run_secs, target, args_info]
        return {"workload": wl[0], "buffers": shapes_, "run_us": float(np.mean(rec[1])) * 1e6}

    report = {"bucket": bucket.label, "db": str(folder), "kernels": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        report["none"] = run_with([], tmp, "none")
        report["all"] = run_with(records, tmp, "all")
        print(f"no record: rel_l2 {report['none']['rel_l2']:.2e}; all {len(records)}: {report['all']['rel_l2']:.2e}",
              flush=True)
        for i, line in enumerate(records):
            row = {**describe(line), **run_with([line], tmp, f"k{i}")}
            report["kernels"].append(row)
            print(f"{row['rel_l2']:.2e}  {row['workload']}  {row['buffers']}  {row['run_us']:.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
