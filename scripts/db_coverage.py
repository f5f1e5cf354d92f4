"""Which committed tuning databases still cover their model's kernels.

A database is keyed by model, target, precision and bucket, not by the
graph the pipeline makes of the model: when a pass changes a kernel, its
records stop applying (ConvNeXt-T b1 on 2026-12-04: none of its 25 kernels
had a record). For each database folder under the root (its `key.json`
names the model, inputs, precision, accumulation and layout), this script
runs the pipeline's export, frontend and optimize stages for that bucket on
this machine (no GPU needed: the kernels are the target's, compared by
MetaSchedule's structural hash) and counts, as the build does, the
module's kernels that have a record it applies (the kernel check's
slower-than-default ones left out), and such records of kernels the module
no longer has: what `deploy/build.py: stale_database` warns of.

    python scripts/db_coverage.py --out DIR                      (every CUDA database under tuning_logs/)
    python scripts/db_coverage.py --models convnext,vit --out DIR

Writes DIR/coverage.json and DIR/coverage.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def coverage(folder: Path, target_name: str, work: Path) -> dict:
    """One database folder's row."""
    from deploy import build, config, export, frontend, optimize, targets
    from deploy.errors import error_line
    from deploy.tuning import database as dbs
    from deploy.tuning import graph, store
    from deploy.tvm_compat import tirx

    key = json.loads((folder / "key.json").read_text())
    row = {"database": str(folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder)}
    try:
        target = targets.resolve(target_name)
        model = key["model"]
        toml = REPO / "configs" / f"{model}.toml"
        cfg = config.load(toml) if toml.is_file() else config.from_dict({"model": {"source": model}})
        batch = key["inputs"][0]["shape"][0]
        table = {"buckets": [batch], "tune_buckets": [batch], "precision": key["precision"], "layout": key["layout"]}
        if key["precision"] == "fp16":
            table["accumulate"] = key["accumulate"]
        cfg = config.apply_overrides(cfg, target.kind, **table)
        profile = cfg.profile(target.kind)
        ex = export.run(cfg, work / "export")
        fe = frontend.run(profile, ex, work / "frontend")
        shapes = [i["shape"] for i in key["inputs"]]
        (bucket,) = [b for b in ex.buckets(profile) if [[b.batch, *i.shape] for i in ex.bucket_inputs(b)] == shapes]
        # (the graph the build makes for this database's bucket: direct convolutions where it was tuned on them)
        direct = frozenset({bucket}) if graph.tuned_direct(folder, batch) else frozenset()
        opt = optimize.run(profile, target, fe, work / "optimize", tuned_direct=direct)
        mod = opt.load_module(bucket)
        # counted as the build counts them: its kernels are the module's PrimFuncs, and the records it
        # applies leave out those whose default schedule was faster (database.open_readonly)
        kernels = sum(isinstance(f, tirx.PrimFunc) for f in mod.functions.values())
        own = dbs.hashes_of(dbs._best_lines(folder, 1, slower_than_default=True))
        counts = build.database_coverage(store.module_hashes(mod, target.tvm_target()), own)
        info = {"kernels": kernels, "database": {"path": row["database"], **counts}}
        row.update(bucket=bucket.label, kernels=kernels, **counts, stale=build.stale_database(info) is not None)
    except Exception as e:  # noqa: BLE001 - the row records what failed
        row["error"] = error_line(e)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(REPO / "tuning_logs"))
    ap.add_argument("--device", default="cuda-sm_90-nvidia-h200", help="the databases' target folder name")
    ap.add_argument("--target", default="cuda:sm_90", help="the target to make the kernels for here")
    ap.add_argument("--models", default="", help="comma-separated model folders (default: all)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    root, out = Path(args.root), Path(args.out)
    if not root.is_dir():
        print(f"error: --root is not a folder: {root} | expected the databases' root, e.g. tuning_logs", file=sys.stderr)
        return 2
    if out.exists() and not out.is_dir():
        print(f"error: --out is not a folder: {out} | expected a folder (made if missing)", file=sys.stderr)
        return 2
    wanted = {m for m in args.models.split(",") if m}
    folders = sorted(f.parent for f in root.glob(f"*/{args.device}/*/key.json")
                     if not wanted or f.parents[2].name in wanted)
    if not folders:
        print(f"error: no database under {root}/<model>/{args.device}/ | expected folders with a key.json",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for folder in folders:
        work = Path(tempfile.mkdtemp(prefix="db-coverage-"))
        try:
            rows.append(coverage(folder, args.target, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(rows[-1], flush=True)
        (out / "coverage.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# Do the committed databases cover their models' kernels?", "",
             f"`python scripts/db_coverage.py --device {args.device} --target {args.target}`: the kernels made here "
             "for each database's bucket, those with a record the build applies (not where the kernel check found the "
             "default schedule faster), and such records of kernels the module no longer has (stale: what the build "
             "warns of).", "",
             "| database | kernels | with a record | records of other kernels | stale |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['database']} | error: {r['error'][:120]} | | | |")
        else:
            lines.append(f"| {r['database']} | {r['kernels']} | {r['kernels_with_records']} | "
                         f"{r['records_of_other_kernels']} | {'yes' if r['stale'] else ''} |")
    (out / "coverage.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
