"""How many of MetaSchedule's draws of a GEMM task pass its postprocessors, with
VerifyGPUCode before RewriteTensorize (TVM 0.27's order) and after it (ours,
deploy/passes/mma_epilogue.py: postprocs). No GPU needed: each task's design
spaces are drawn with fresh random decisions on the CPU, and every draw that
passes only our order is built for the target (`lean_build`: TVM's TIR
pipeline, then nvcc) to show that it compiles.

    python scripts/verify_order_probe.py --gemms 12544x256x1024,6400x1536x384 --draws 48 --out DIR

Each GEMM is fp16 with an fp32 sum, then a cast, a bias and a ReLU (a CNN's
1x1 convolution flattened, a transformer's dense layer). Writes probe.json
and probe.md in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # (probe_common.py)


def probe(shape: tuple[int, int, int], draws: int, target_name: str) -> dict:
    import probe_common

    from deploy import targets
    from deploy.passes import mma_epilogue
    from deploy.tuning import builder
    from deploy.tvm_compat import ms, register_tensor_intrinsics, s_tir

    register_tensor_intrinsics()
    target = targets.resolve(target_name).tvm_target()
    mod = probe_common.gemm_module(*shape, "bias-relu")
    ours = mma_epilogue.postprocs(target)
    # TVM's order: our VerifyGPUCode's place, TVM's own check, RewriteTensorize last
    verify_at = next(i for i, p in enumerate(ours) if "RewriteTensorize" in str(type(p))) + 1
    theirs = [*ours[:verify_at - 1], ms.postproc.VerifyGPUCode(), ours[verify_at - 1]]
    ctx = ms.TuneContext(mod=mod, target=target, space_generator=ms.space_generator.PostOrderApply(postprocs=ours),
                         rand_state=1)
    for p in [*ours, *theirs]:
        p._initialize_with_tune_context(ctx)
    row = {"gemm": "x".join(str(d) for d in shape), "draws": 0, "tvm_order": 0, "our_order": 0, "only_tvm": 0, "only_ours_built": 0,
           "only_ours_failed": [],
           "seconds": {"tvm_order": 0.0, "our_order": 0.0}}
    seed = 0
    while row["draws"] < draws:
        seed += 1
        spaces = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                                rand_state=seed).generate_design_space()
        for space in spaces:
            if row["draws"] >= draws:
                break
            row["draws"] += 1
            verdicts = {}
            for label, posts in (("tvm_order", theirs), ("our_order", ours)):
                sch = s_tir.Schedule(mod, debug_mask=0)
                space.trace.apply_to_schedule(sch, remove_postproc=True)
                t = time.time()
                try:
                    verdicts[label] = all(p.apply(sch) for p in posts)
                except Exception:  # noqa: BLE001 - a postprocessor that raises rejects the draw, as in the search
                    verdicts[label] = False
                row["seconds"][label] += time.time() - t
                row[label] += verdicts[label]
                if label == "our_order" and verdicts["tvm_order"] and not verdicts[label]:
                    row["only_tvm"] += 1
                if label == "our_order" and verdicts[label] and not verdicts["tvm_order"]:
                    try:
                        builder.lean_build(sch.mod, target, None)
                        row["only_ours_built"] += 1
                    except Exception as e:  # noqa: BLE001 - said in the row
                        row["only_ours_failed"].append(str(e).strip().splitlines()[-1][:160])
    row["seconds"] = {key: round(v, 2) for key, v in row["seconds"].items()}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemms", default="12544x256x1024,6400x1536x384", help="MxNxK, comma-separated")
    p.add_argument("--draws", type=int, default=48)
    p.add_argument("--target", default="cuda:sm_90")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import probe_common

    shapes = probe_common.parse_shapes(args.gemms)
    if shapes is None:
        return 2
    if args.draws < 1:
        print(f"error: --draws must be positive | got {args.draws}", file=sys.stderr)
        return 2
    rows = [probe(s, args.draws, args.target) for s in shapes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"target": args.target, "rows": rows}, indent=1))
    lines = [f"# MetaSchedule's draws of a GEMM task through its postprocessors ({args.target})", "",
             f"`python scripts/verify_order_probe.py --gemms {args.gemms} --draws {args.draws}`", "",
             "| GEMM (+ bias, ReLU) | draws | pass, VerifyGPUCode first (TVM) | pass, RewriteTensorize first (ours) "
             "| only ours passes: built | only TVM's passes | postprocessor seconds (TVM / ours) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gemm']} | {r['draws']} | {r['tvm_order']} | {r['our_order']} | {r['only_ours_built']}"
                     f" of {r['only_ours_built'] + len(r['only_ours_failed'])} | {r['only_tvm']} |"
                     f" {r['seconds']['tvm_order']} / {r['seconds']['our_order']} |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
