"""How often tuning tasks' candidates fail, over the tune summaries in a
results tree: per task tuned in a run (new trials), the share of its
candidates that failed to build or run, the worst first, and the tasks that
measured candidates and kept none valid. Reads `tune-summary.json` files
(written by the tune stage); needs no device.

    python3 scripts/tune_failures.py results [--min-trials 8] [--top 10]

Whether retrying "tasks whose candidates keep failing" with another rule
(issue 17) has anything to retry: exit 0 either way; the report says.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def task_rows(root: Path) -> list[dict]:
    """One row per task tuned in a run: summary file, bucket, task, new trials, failed candidates, best us."""
    rows = []
    for path in sorted(root.rglob("tune-summary.json")):
        summary = json.loads(path.read_text())
        for bucket, entry in summary.items():
            if not isinstance(entry, dict):
                continue
            for name, task in (entry.get("tasks") or {}).items():
                trials = int(task.get("new_trials") or 0)
                if trials <= 0:
                    continue
                failed = int(task.get("build_errors") or 0) + int(task.get("run_errors") or 0)
                rows.append({"summary": str(path.relative_to(root).parent), "bucket": bucket, "task": name,
                             "trials": trials, "failed": failed, "best_us": task.get("best_us")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, help="a folder searched for tune-summary.json files")
    ap.add_argument("--min-trials", type=int, default=8, help="tasks with at least this many new trials")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)
    if not args.root.is_dir():
        print(f"error: {args.root} is not a folder | give the results folder", file=sys.stderr)
        return 2
    rows = task_rows(args.root)
    counted = [r for r in rows if r["trials"] >= args.min_trials]
    none_valid = [r for r in counted if r["best_us"] is None]
    summaries = len({r["summary"] for r in rows})
    print(f"{len(rows)} tasks tuned in {summaries} summaries; {len(counted)} with {args.min_trials}+ new trials; "
          f"{len(none_valid)} of them kept no valid candidate")
    for r in sorted(counted, key=lambda r: -r["failed"] / r["trials"])[:args.top]:
        print(f"  {r['failed'] / r['trials']:5.0%} of {r['trials']:4d} failed  {r['task'][:48]:48s}  "
              f"b{r['bucket']}  {r['summary']}")
    for r in none_valid:
        print(f"  no valid candidate: {r['task']} b{r['bucket']} ({r['summary']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
