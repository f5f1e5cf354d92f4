"""How long MetaSchedule candidates of a model's heaviest tasks take to build
for a CUDA target on this machine: the same build and export the tuner's
workers run (deploy.tuning.builder.lean_build + so_export), one candidate at a time, on
random samples of each task's design space.

Where TVM's CUDA runtime cannot load (no GPU driver), tvm.tirx.build returns
a fallback module holding the CUDA source and compiles nothing: the times then
cover lowering and export only, not NVRTC, and the report says so. Compile
times are measured on the GPU machine (the tuner's "building:" line) or with
scripts/nvrtc_profile.py.

    .venv/bin/python scripts/candidate_build_profile.py --model resnet50 --precision fp32 \\
        --tasks 3 --candidates 24 --out results/cpu/2026-11-29/candidate-builds-fp32

With --database DIR (a tuning database folder under tuning_logs/) it builds
measured records instead, the candidates the search actually picked: up to
--candidates records of each of the --tasks workloads with the most records.

Writes results.json (every candidate's seconds) and results.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import results_files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's deploy/, also without the venv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    ap.add_argument("--bucket", type=int, default=1)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--tasks", type=int, default=3, help="the heaviest N convolution/matmul tasks")
    ap.add_argument("--candidates", type=int, default=24, help="random candidates per task")
    ap.add_argument("--database", help="replay records of this tuning database instead of sampling")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.database:
        return replay(args)

    from deploy import config, export, frontend, optimize, targets
    from deploy.cli import resolve_config
    from deploy.tuning import search as tune_search
    from deploy.tuning import tasks as tune_tasks
    from deploy.tvm_compat import ms

    cfg = resolve_config(argparse.Namespace(model=args.model, config=None, input=None, checkpoint=None, seed=None))
    target = targets.resolve(f"cuda:{args.arch}")
    cfg = config.apply_overrides(cfg, "cuda", precision=args.precision, buckets=(args.bucket,),
                                 tune_buckets=(args.bucket,))
    profile = cfg.profile("cuda")
    tgt = target.tvm_target()
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="build-profile-") as tmp:
        work = Path(tmp)
        ex = export.run(cfg, work / "export")
        fe = frontend.run(profile, ex, work / "frontend")
        opt = optimize.run(profile, target, fe, work / "optimize")
        tasks = [t for t in tune_tasks.extract_tasks(opt.load_module(args.bucket), tgt)
                 if "conv2d" in t.task_name or "matmul" in t.task_name]
        tasks = sorted(tasks, key=lambda t: -tune_tasks.task_flops(t))[: args.tasks]
        for task in tasks:
            space, _ = tune_search._design_space(task.dispatched[0], tgt, seed=1)
            ctx = ms.TuneContext(mod=task.dispatched[0], target=tgt, space_generator=space,
                                 search_strategy=ms.search_strategy.ReplayTrace(), task_name=task.task_name,
                                 rand_state=7)
            spaces = ctx.generate_design_space()
            ctx.pre_tuning(max_trials=args.candidates, num_trials_per_iter=args.candidates, design_spaces=spaces)
            seconds = [_timed(c.sch.mod, tgt) for c in ctx.generate_measure_candidates()]
            out[task.task_name] = seconds
            print(f"{task.task_name}: {len(seconds)} candidates, p50 {np.median(seconds):.2f} s", flush=True)
    return _write(args, out, f"random candidates of {args.model} {args.precision} batch {args.bucket}, cuda {args.arch}")


FAILED: list[str] = []  # the candidates that did not build (timed too)


def _timed(mod, tgt) -> float:
    import shutil

    from deploy.tuning import builder as tune_builder
    from deploy.tuning import tasks as tune_tasks

    t0 = time.perf_counter()
    try:
        path = tune_builder.so_export(tune_builder.lean_build(mod, tgt, None))
    except Exception as e:  # noqa: BLE001  a failed build is timed and counted
        FAILED.append(tune_tasks._failure_reason(str(e)))
        return time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return seconds


def replay(args) -> int:
    from deploy.tuning import database as dbs
    from deploy.tvm_compat import Target, structural_hash, tvm

    folder = Path(args.database)
    key = json.loads((folder / "key.json").read_text())
    tgt = Target(json.loads(key["target"]["target"]))
    with tempfile.TemporaryDirectory(prefix="build-profile-") as tmp:
        dbs._expand(folder, Path(tmp))
        records = list(dbs._json_database(Path(tmp)).get_all_tuning_records())
    by: dict[int, list] = {}
    for r in records:
        by.setdefault(structural_hash(r.workload.mod), []).append(r)
    out: dict[str, list[float]] = {}
    for k, (_, rs) in enumerate(sorted(by.items(), key=lambda kv: -len(kv[1]))[: args.tasks]):
        seconds = []
        for r in rs[: args.candidates]:
            sch = tvm.s_tir.Schedule(r.workload.mod)
            r.trace.apply_to_schedule(sch, remove_postproc=False)
            seconds.append(_timed(sch.mod, tgt))
        out[f"workload {k + 1} ({len(rs)} records)"] = seconds
    # What was measured comes from the database's key, not from the command line.
    args.model, args.precision = key["model"], key["precision"]
    args.bucket = key["inputs"][0]["shape"][0]
    args.arch = key["target"]["arch"]
    return _write(args, out, f"records of {folder}")


def _write(args, out: dict[str, list[float]], what: str) -> int:
    from deploy.tvm_compat import tvm

    compiled = bool(tvm.runtime.enabled("cuda"))
    report = {"model": args.model, "precision": args.precision, "bucket": args.bucket, "arch": args.arch,
              "what": what, "cuda_compiled": compiled, "failed": len(FAILED), "failures": sorted(set(FAILED)),
              "seconds": out}
    note = [] if compiled else ["**No CUDA runtime here: the kernels were lowered and exported as source, not "
                                "compiled (no NVRTC). These times leave out the CUDA compile.**", ""]
    lines = [f"# Candidate builds, one at a time: {what}", "", *note,
             "| task | candidates | p50 s | p90 s | max s | sum s |", "|---|---|---|---|---|---|"]
    for name, s in out.items():
        a = np.asarray(s)
        lines.append(f"| {name} | {a.size} | {np.median(a):.2f} | {np.percentile(a, 90):.2f} | {a.max():.2f} | {a.sum():.1f} |")
    lines += ["", f"{len(FAILED)} of {sum(len(s) for s in out.values())} failed to build (timed all the same)."]
    return results_files.write(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
