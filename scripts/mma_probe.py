"""Why TVM 0.27's `mma.sync` tensor-core rule (m16n8k8 with ldmatrix, dynamic
shared memory, a permuted layout and software pipelining) yields no valid
candidate: for a model's heaviest CUDA tasks, each of N seeds generates the
design space with that rule alone (the WMMA rule left out), applies the
postprocessors, and builds what passes, or, past a failing VerifyGPUCode,
builds anyway to see what the lowering says. No GPU needed.

    python scripts/mma_probe.py --model resnet50 --batch 64 --tasks 2 --seeds 40 \\
        --out results/cpu/DATE/mma-probe-resnet50-b64

`--gemm M,N,K` probes a plain fp16 GEMM with fp32 accumulation instead
(`--epilogue none|cast|bias-relu`: what follows the product in the kernel,
the last as in a fused convolution). `--samples N` also replays the design
space N times with fresh tile decisions, as the search's first population
is drawn, and counts how many pass every postprocessor. `--fix-epilogue`
adds our workaround of the epilogue's write-back
(deploy/passes/mma_epilogue.py) to the postprocessors.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (probe_common.py)


def _last(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return (lines[-1] if lines else type(e).__name__)[:140]


def probe(task, tgt, seeds: int, postprocs="cuda-tensorcore") -> dict:
    from deploy.tuning import builder
    from deploy.tvm_compat import ms

    rules = ms.ScheduleRule.create("cuda-tensorcore")  # [custom, WMMA tiling, mma tiling, SIMT tiling, ...]
    mma_only = [rules[0], rules[2], *rules[3:]]
    out = collections.Counter()
    for seed in range(1, seeds + 1):
        ctx = ms.TuneContext(mod=task.dispatched[0], target=tgt, rand_state=seed,
                             space_generator=ms.space_generator.PostOrderApply(
                                 sch_rules=mma_only, postprocs=postprocs, mutator_probs="cuda-tensorcore"))
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


def valid_share(task, tgt, samples: int, postprocs="cuda-tensorcore") -> dict:
    """The design space replayed `samples` times with every decision drawn
    anew: how many pass each postprocessor (the first refusal counted)."""
    from deploy.tvm_compat import ms, s_tir

    rules = ms.ScheduleRule.create("cuda-tensorcore")
    ctx = ms.TuneContext(mod=task.dispatched[0], target=tgt, rand_state=1,
                         space_generator=ms.space_generator.PostOrderApply(
                             sch_rules=[rules[0], rules[2], *rules[3:]], postprocs=postprocs,
                             mutator_probs="cuda-tensorcore"))
    try:
        trace = ctx.generate_design_space()[0].trace
    except Exception as e:  # noqa: BLE001
        return {f"design space: {_last(e)}": samples}
    out = collections.Counter()
    for k in range(samples):
        sch = s_tir.Schedule(task.dispatched[0], seed=k + 1)
        try:
            s_tir.Trace(trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        except Exception as e:  # noqa: BLE001
            out[f"replay: {_last(e)}"] += 1
            continue
        for p in ctx.space_generator.postprocs:
            try:
                ok = p.apply(sch)
            except Exception:  # noqa: BLE001
                ok = False
            if not ok:
                out[f"refused by {str(p).split('(')[0].split('.')[-1]}"] += 1
                break
        else:
            out["valid"] += 1
    return dict(out.most_common())


class _Gemm:
    """A task-like GEMM: C[m, n] = sum_k A[m, k] B[k, n] (fp16 in, fp32 sum), then the epilogue."""

    def __init__(self, m: int, n: int, k: int, epilogue: str):
        import probe_common

        self.task_name = f"gemm_{m}x{n}x{k}_{epilogue}"
        self.dispatched = [probe_common.gemm_module(m, n, k, epilogue)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--gemm", help="M,N,K: a plain GEMM instead of the model's tasks")
    ap.add_argument("--epilogue", default="none", choices=("none", "cast", "bias-relu"))
    ap.add_argument("--samples", type=int, default=0, help="also count valid draws among this many")
    ap.add_argument("--fix-epilogue", action="store_true", help="with deploy/passes/mma_epilogue.py's postprocessor")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from deploy import targets
    from deploy.tvm_compat import register_tensor_intrinsics

    register_tensor_intrinsics()  # the rules name TVM's tensor intrinsics

    target = targets.resolve("cuda:sm_90")
    if args.gemm:
        heaviest = [_Gemm(*(int(x) for x in args.gemm.split(",")), args.epilogue)]
        what = f"GEMM {args.gemm} fp16 (fp32 sum), epilogue {args.epilogue}"
    else:
        heaviest = _heaviest(args, target)
        what = f"{args.model}, fp16, batch {args.batch}"
    pp = "cuda-tensorcore"
    if args.fix_epilogue:
        from deploy.passes import mma_epilogue

        pp = mma_epilogue.postprocs(target.tvm_target())
        what += ", with our epilogue workaround"
    results = {t.task_name: probe(t, target.tvm_target(), args.seeds, pp) for t in heaviest}
    shares = {t.task_name: valid_share(t, target.tvm_target(), args.samples, pp) for t in heaviest} \
        if args.samples else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"design_spaces": results, "samples": shares}, indent=1) + "\n")
    lines = [f"# TVM 0.27's mma.sync rule alone: {what}, sm_90, {args.seeds} seeds a task",
             "", f"`python scripts/mma_probe.py {' '.join(sys.argv[1:])}`", ""]
    for name, counts in results.items():
        lines += [f"## {name}", "", "Design spaces (each seed's, built past a failing VerifyGPUCode):", ""]
        lines += [f"- {n} x {outcome}" for outcome, n in counts.items()] + [""]
        if name in shares:
            lines += [f"{args.samples} draws of the first design space's decisions:", ""]
            lines += [f"- {n} x {outcome}" for outcome, n in shares[name].items()] + [""]
    (out / "probe.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def _heaviest(args, target) -> list:
    from deploy import config, export, frontend, optimize
    from deploy.tuning import tasks

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
    return sorted(found, key=lambda t: -tasks.task_flops(t) * t.weight)[: args.tasks]


if __name__ == "__main__":
    sys.exit(main())
