"""Which tuning tasks of the corpus models get a design space on a target,
and from which rules: MetaSchedule's default rules (on CUDA with tensor
cores), the rules without tensor cores (the fallback of
`deploy/tuning/search.py`), or none (left to the default schedules). No GPU
is needed: design spaces are generated and sampled on the CPU.

    python scripts/design_spaces.py --target cuda:sm_90 --batch 1 --out results/cpu/DATE/design-spaces-cuda-b1
    python scripts/design_spaces.py --models resnet50 --batch 64 --implicit-gemm --out ...   (the profile's implicit_gemm)

A task counts under "our mma.sync" where deploy/passes/mma_gemm.py offers
it at least one configuration (besides the rules' spaces).

Writes design_spaces.json and design_spaces.md in --out; resumable (models
already in the JSON are skipped).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # (probe_common.py)


def census(name: str, target_name: str, batch: int, precision: str, work: Path, implicit_gemm: bool = False) -> dict:
    import probe_common

    import models
    from deploy import targets
    from deploy.errors import error_line
    from deploy.passes import mma_gemm
    from deploy.tuning import search, tasks
    from deploy.tvm_compat import ms

    target = targets.resolve(target_name)
    spec = models.get(name)
    entry = {"model": name, "kind": spec.kind, "batch": batch, "precision": precision}
    try:
        opt = probe_common.optimize_model(name, target, batch, precision, work, implicit_gemm)
        found = tasks.extract_tasks(opt.load_module(batch), target.tvm_target())
    except Exception as e:  # noqa: BLE001 - the outcome is the answer
        entry["error"] = error_line(e)
        return entry
    rules = collections.Counter()
    entry["without_tensor_cores"], entry["none"], entry["mma"] = {}, {}, {}
    for t in found:
        space, cache = search._design_space(t.dispatched[0], target.tvm_target(), seed=1)
        try:
            ms.TuneContext(mod=t.dispatched[0], target=target.tvm_target(), space_generator=space,
                           rand_state=1).generate_design_space()
            rules[cache["rules"]] += 1
            if cache["rules"] != "default":
                entry["without_tensor_cores"][t.task_name] = cache["default_error"]
        except Exception as e:  # noqa: BLE001
            rules["none"] += 1
            entry["none"][t.task_name] = tasks._first_line(str(e))
        # our spaces are the last `own` the search generated (tuning/search.py), ShortReduction's among them
        spaces = cache.get("spaces", [])
        n_mma = sum(mma_gemm.is_ours(x.mod) for x in spaces[len(spaces) - cache.get("own", 0):])
        if n_mma:
            entry["mma"][t.task_name] = n_mma
    entry["tasks"] = len(found)
    entry["default"], entry["fallback"], entry["no_space"] = rules["default"], rules[search.SIMT_FALLBACK], rules["none"]
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cuda:sm_90")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--models", default="", help="comma-separated corpus names (default: all)")
    ap.add_argument("--implicit-gemm", action="store_true", help="the profile's implicit_gemm (passes/implicit_gemm.py)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import models

    names = [n for n in args.models.split(",") if n] or [s.name for s in models.CORPUS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "design_spaces.json"
    done = json.loads(path.read_text()) if path.is_file() else []
    have = {e["model"] for e in done}
    for name in names:
        if name in have:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"ds-{name}-"))
        try:
            entry = census(name, args.target, args.batch, args.precision, work, args.implicit_gemm)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        done.append(entry)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(done, indent=1))
        tmp.replace(path)
        print(f"{name}: " + (entry.get("error") or
              f"{entry['tasks']} tasks, {entry['default']} default rules, {entry['fallback']} without tensor cores, "
              f"{entry['no_space']} none, {len(entry['mma'])} with our mma.sync"), flush=True)
    flag = " --implicit-gemm" if args.implicit_gemm else ""
    lines = [f"# Design spaces of the corpus: {args.target}, {args.precision}, batch {args.batch}{flag}", "",
             f"`python scripts/design_spaces.py --target {args.target} --batch {args.batch} --precision {args.precision}"
             f"{flag}`", "",
             "| model | tasks | default rules | without tensor cores | none | our mma.sync (configurations) |",
             "|---|---|---|---|---|---|"]
    for e in done:
        if "error" in e:
            lines.append(f"| {e['model']} | error: {e['error'][:120]} | | | | |")
        else:
            mma = e.get("mma")  # (absent in results written before the column)
            mma_text = "" if mma is None else f"{len(mma)} ({sum(mma.values())})"
            lines.append(f"| {e['model']} | {e['tasks']} | {e['default']} | {e['fallback']} | {e['no_space']} "
                         f"| {mma_text} |")
    (out / "design_spaces.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
