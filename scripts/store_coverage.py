"""How much of each corpus model the kernel store covers before the model is
tuned itself: for each model (fp16, batch 1 by default), how many of its
kernels, and what share of its FLOPs, have a tuning record in the databases
of *other* models made for the store's GPU, and in the store as a whole.

Answers in results/cpu/<date>/store-coverage/ (coverage.md, coverage.json):

    python scripts/store_coverage.py --out results/cpu/2026-12-02/store-coverage
    python scripts/store_coverage.py --models resnet18,resnet50 --buckets 1,64 --out ...

The modules are exported, imported and optimized for cuda:sm_90 on any
machine (no GPU needed): a kernel's workload, its TIR, does not depend on the
GPU being there. The databases are those under --db-root for --store (a
target folder name such as cuda-sm_90-nvidia-h200).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def recorded(db_root: Path, slug: str) -> dict[str, set[str]]:
    """model -> the workloads that have a valid record in its databases for `slug`."""
    from deploy.tuning import database as dbs
    from deploy.tuning import store

    out: dict[str, set[str]] = {}
    for folder, key in store.databases(db_root):
        if folder.parent.name != slug:
            continue
        workloads, records = dbs._all_lines(folder)
        have = out.setdefault(key["model"], set())
        for ln in records:
            wi, rec = json.loads(ln)
            if dbs._mean_secs(rec) != float("inf"):
                have.add(json.loads(workloads[wi])[0])
    return out


def model_tasks(name: str, bucket: int, precision: str, work: Path) -> list[tuple[str, float]]:
    """(workload hash, FLOPs x occurrences) of each kernel of the optimized module."""
    from deploy import config, export, frontend, optimize, targets
    from deploy.tuning import store
    from deploy.tuning import tasks as task_loop

    target = targets.resolve("cuda:sm_90")
    cfg = config.from_dict({"model": {"source": name}, "cuda": {"buckets": [bucket], "tune_buckets": [],
                                                                 "trials": 0, "precision": precision}})
    profile = cfg.profile("cuda")
    ws = work / f"{name}-{precision}-b{bucket}"
    ex = export.run(cfg, ws / "export")
    front = frontend.run(profile, ex, ws / "frontend")
    opt = optimize.run(profile, target, front, ws / "optimize")
    tasks = task_loop.extract_tasks(opt.load_module(bucket), target.tvm_target())
    hashes = [next(iter(store.workload_hashes([t.dispatched[0]]))) for t in tasks]
    return [(h, task_loop.task_flops(t) * float(t.weight)) for h, t in zip(hashes, tasks)]


def markdown(report: dict) -> str:
    lines = [
        f"# Kernel store coverage ({report['date']})",
        "",
        f"Databases under `{report['db_root']}` for `{report['store']}`; modules built for cuda:sm_90 at "
        f"{report['precision']}. Command: `{report['command']}`",
        "",
        "Machine: any (the modules are built for cuda:sm_90 without a GPU). "
        "A kernel is covered when a database has a valid record for its workload (its TIR).",
        "'by others' counts only databases of other models: what a new model starts from.",
        "",
        "| model | bucket | kernels | by others | FLOPs by others | in the store | FLOPs in the store |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['bucket']} | error: {r['error'][:80]} | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['bucket']} | {r['kernels']} | {r['by_others']} | "
                     f"{r['flops_by_others']:.0%} | {r['in_store']} | {r['flops_in_store']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma list (default: the whole registry)")
    ap.add_argument("--buckets", default="1")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--db-root", default=str(REPO / "tuning_logs"))
    ap.add_argument("--store", default="cuda-sm_90-nvidia-h200", help="the target folder whose databases count")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import models

    names = [n.strip() for n in args.models.split(",") if n.strip()] or models.names()
    db_root = Path(args.db_root)
    by_model = recorded(db_root, args.store)
    store_all = set().union(*by_model.values()) if by_model else set()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown_root = db_root.resolve().relative_to(REPO) if db_root.resolve().is_relative_to(REPO) else db_root
    report = {"date": time.strftime("%Y-%m-%d"), "db_root": str(shown_root), "store": args.store,
              "precision": args.precision, "results": [],
              "databases": {m: len(s) for m, s in sorted(by_model.items())},
              "command": "python scripts/store_coverage.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    work = Path(tempfile.mkdtemp(prefix="store-coverage-"))
    for name in names:
        for bucket in (int(b) for b in args.buckets.split(",")):
            entry = {"model": name, "bucket": bucket}
            try:
                tasks = model_tasks(name, bucket, args.precision, work)
            except Exception as e:  # noqa: BLE001 - a model that does not import is a row of the answer
                entry["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
                report["results"].append(entry)
                continue
            others = set().union(*(s for m, s in by_model.items() if m != name)) if by_model else set()
            total = sum(f for _, f in tasks) or 1.0
            entry.update({
                "kernels": len(tasks),
                "by_others": sum(h in others for h, _ in tasks),
                "flops_by_others": sum(f for h, f in tasks if h in others) / total,
                "in_store": sum(h in store_all for h, _ in tasks),
                "flops_in_store": sum(f for h, f in tasks if h in store_all) / total,
            })
            report["results"].append(entry)
            print(f"{name} b{bucket}: {entry['by_others']}/{entry['kernels']} kernels by other models "
                  f"({entry['flops_by_others']:.0%} of FLOPs), {entry['in_store']} in the store", flush=True)
            (out / "coverage.json").write_text(json.dumps(report, indent=1))
            (out / "coverage.md").write_text(markdown(report))
    (out / "coverage.json").write_text(json.dumps(report, indent=1))
    (out / "coverage.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
