"""Why TVM 0.27's `mma.sync` tensor-core rule (m16n8k8 with ldmatrix, dynamic
shared memory, a permuted layout and software pipelining) yields no valid
candidate: for a model's heaviest CUDA tasks, each of N seeds generates the
design space with that rule alone (the WMMA rule left out), applies the
postprocessors, and builds what passes, or, past a failing VerifyGPUCode,
builds anyway to see what the lowering says. No GPU needed.

    python scripts/mma_probe.py --model resnet50 --batch 64 --tasks 2 --seeds 40 \\
        --out results/cpu/DATE/mma-probe-resnet50-b64

Writes probe.json and probe.md in --out (outcome counts per task).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _last(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return (lines[-1] if lines else type(e).__name__)[:140]


def probe(task, tgt, seeds: int) -> dict:
    from deploy.tuning import builder
    from deploy.tvm_compat import ms

    rules = ms.ScheduleRule.create("cuda-tensorcore")  # [custom, WMMA tiling, mma tiling, SIMT tiling, ...]
    mma_only = [rules[0], rules[2], *rules[3:]]
    out = collections.Counter()
    for seed in range(1, seeds + 1):
        ctx = ms.TuneContext(mod=task.dispatched[0], target=tgt, rand_state=seed,
                             space_generator=ms.space_generator.PostOrderApply(
                                 sch_rules=mma_only, postprocs="cuda-tensorcore", mutator_probs="cuda-tensorcore"))
        try:
            sch = ctx.generate_design_space()[0]
        except Exception as e:  # noqa: BLE001 - the outcome is the answer
            out[f"design space: {_last(e)}"] += 1
            continue
        verify_failed = False
        for p in ctx.space_generator.postprocs:
            name = str(p).split("(")[0].split(".")[-1]
            try:
                ok = p.apply(sch)
            except Exception as e:  # noqa: BLE001
                out[f"postprocessor {name} raised: {_last(e)}"] += 1
                break
            if not ok and name == "VerifyGPUCode":
                verify_failed = True  # go on: what does the build say?
            elif not ok:
                out[f"postprocessor {name} refused"] += 1
                break
        else:
            what = "VerifyGPUCode refused; built anyway: " if verify_failed else ""
            try:
                lib = builder.lean_build(sch.mod, tgt, None)
                src = next(m for m in lib.imports if m.kind == "cuda").inspect_source()
                out[what + "built (" + ", ".join(k for k in ("mma.sync", "ldmatrix", "cp.async") if k in src) + ")"] += 1
            except Exception as e:  # noqa: BLE001
                out[what + f"build failed: {_last(e)}"] += 1
    return dict(out.most_common())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tvm.s_tir.tensor_intrin  # noqa: F401 - the rules name TVM's tensor intrinsics

    from deploy import config, export, frontend, optimize, targets
    from deploy.tuning import tasks

    target = targets.resolve("cuda:sm_90")
    cfg = config.from_dict({"model": {"source": args.model},
                            "cuda": {"buckets": [args.batch], "tune_buckets": [args.batch],
                                     "precision": "fp16", "layout": "NHWC"}})
    work = Path(tempfile.mkdtemp(prefix="mma-probe-"))
    try:
        ex = export.run(cfg, work / "export")
        fe = frontend.run(cfg.cuda, ex, work / "frontend")
        opt = optimize.run(cfg.cuda, target, fe, work / "optimize")
        found = tasks.extract_tasks(opt.load_module(args.batch), target.tvm_target())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    heaviest = sorted(found, key=lambda t: -tasks.task_flops(t) * t.weight)[: args.tasks]
    results = {t.task_name: probe(t, target.tvm_target(), args.seeds) for t in heaviest}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# TVM 0.27's mma.sync rule alone: {args.model}, fp16, batch {args.batch}, sm_90, {args.seeds} seeds a task",
             "", f"`python scripts/mma_probe.py --model {args.model} --batch {args.batch} --tasks {args.tasks} "
             f"--seeds {args.seeds}`", ""]
    for name, counts in results.items():
        lines += [f"## {name}", ""] + [f"- {n} x {what}" for what, n in counts.items()] + [""]
    (out / "probe.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
