"""Our mma.sync GEMM as the untuned default (`deploy/passes/mma_gemm.py:
Default`) against DLight's Matmul, the default it replaced, on every kernel
of the named models that it takes: each kernel built both ways as the
package builds it, run on the same seeded inputs, their outputs compared,
and each timed with TVM's time_evaluator. Needs a GPU to time (on the CPU
machine, `--target cuda:sm_90 --no-run` builds both and stops there).

    python scripts/mma_default_probe.py --models convnext:32,vit:32,resnet50:64:implicit --out DIR

A model is NAME:BATCH, with `:implicit` for the profile's implicit_gemm.
Only kernels whose first source in the build's chain is that rule are
probed (passes/schedule.py: FewOutputs comes before it). Writes
DIR/probe.json and DIR/probe.md (saved after each model); exit 1 when a
kernel's two outputs differ by more than the kernel check's fp16
tolerance, or a kernel or a model fails (its row says why), 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import probe_common  # noqa: E402 - scripts/probe_common.py, beside this file

TOLERANCE = 2e-2  # rel_l2 between the two outputs, as tuning/check.py's for fp16


def parse_models(text: str) -> list[tuple[str, int, bool]] | None:
    """[(model, batch, implicit_gemm)] of 'name:batch[:implicit],...', or None."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit() or int(parts[1]) < 1 \
                or (len(parts) == 3 and parts[2] != "implicit"):
            return None
        out.append((parts[0], int(parts[1]), len(parts) == 3))
    return out or None


def kernels(name: str, batch: int, implicit: bool, target, work: Path) -> list[tuple[str, str, object, int]]:
    """[(bucket label, task name, PrimFunc, calls a run)] of the model's
    tuning tasks at this batch (every bucket of it: BERT's sequence lengths)."""
    from deploy.tuning import tasks

    opt = probe_common.optimize_model(name, target, batch, "fp16", work, implicit)
    out = []
    for bucket in sorted(b for b in opt.modules if b.batch == batch):
        for t in tasks.extract_tasks(opt.load_module(bucket), target.tvm_target()):
            out.append((bucket.label, t.task_name, t.dispatched[0]["main"], int(t.weight)))
    return out


def compare(func, target, run: bool) -> dict | None:
    """One kernel both ways; None where our default does not take it."""
    import numpy as np

    from deploy.build import build_kernel
    from deploy.passes import mma_gemm, schedule
    from deploy.tvm_compat import dlight, ms, tvm

    tvm_target = target.tvm_target()
    first = next((s for s in schedule._sources(None, func, None, tvm_target, "cuda")
                  if not isinstance(s[1], Exception)), (None, None))
    if first[0] != schedule.MMA_GEMM:  # (the build gives it another schedule)
        return None
    ours = first[1]  # (scheduled by the rule, as the build takes it)
    gemm, padding, _ = mma_gemm.plan_any(func)  # (a GEMM over [1, M, K] rows too: passes/unit_batch.py)
    row = {"gemm": f"{gemm.m}x{gemm.n}x{gemm.k}", "config": mma_gemm.default_config(gemm, tvm_target)}
    if padding is not None:
        row["note"] = f"rows padded to {gemm.m} in the kernel"
    with tvm_target:
        theirs = dlight.gpu.Matmul().apply(func, tvm_target, False)
    if theirs is None:
        row["note"] = "DLight's Matmul does not take it"
        return row
    libs = {"dlight": build_kernel("k", theirs.mod["main"], target), "ours": build_kernel("k", ours, target)}
    if not run:
        return row
    dev = tvm.cuda(0)
    info = ms.arg_info.ArgInfo.from_prim_func(func)
    rng = np.random.default_rng(0)
    host = [(rng.standard_normal([int(d) for d in a.shape]) / 4).astype(str(a.dtype)) for a in info]
    outs = {}
    for label, lib in libs.items():
        args = [tvm.runtime.tensor(a, dev) for a in host]
        lib["k"](*args)
        outs[label] = args[-1].numpy().astype("float64")
        if np.array_equal(outs[label], host[-1].astype("float64")):  # (equal outputs must be written ones)
            row["error"] = f"{label}'s kernel left its output as it was"
        row[label + "_us"] = round(probe_common.tvm_us(lib, dev, *args, name="k", number=50), 2)
    ref = outs["dlight"]
    row["rel_l2"] = float(np.linalg.norm(outs["ours"] - ref) / max(np.linalg.norm(ref), 1e-30))
    row["speedup"] = round(row["dlight_us"] / row["ours_us"], 2)
    return row


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"device: {meta['device']}; each kernel's median of 5 x 50 calls (time_evaluator); "
             "a model's totals weighted by calls a run (scripts/mma_default_probe.py)", "",
             "| model | bucket | kernel | calls | GEMM MxNxK | our tile | DLight us | ours us | speed-up | rel_l2 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['bucket']} | {r['kernel']} | {r['calls']} | {r['gemm']} | {r['config']} | "
                     f"{r.get('dlight_us', '')} | {r.get('ours_us', '')} | {r.get('speedup', '')} | "
                     f"{'' if 'rel_l2' not in r else format(r['rel_l2'], '.2e')} |"
                     + "".join(f" {r[k]}" for k in ("error", "note") if k in r))
    totals = {}
    for r in rows:
        if "ours_us" in r:
            t = totals.setdefault((r["model"], r["bucket"]), [0.0, 0.0])
            t[0] += r["dlight_us"] * r["calls"]
            t[1] += r["ours_us"] * r["calls"]
    if totals:
        lines += ["", "| model | bucket | DLight us a run | ours us a run |", "|---|---|---|---|"]
        lines += [f"| {m} | {b} | {d:.1f} | {o:.1f} |" for (m, b), (d, o) in totals.items()]
    (out / "probe.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="convnext:32,vit:32,bert:32,resnet50:64:implicit,convnext:1,bert:1")
    p.add_argument("--target", default=None, help="default: cuda on a GPU, else cuda:sm_90")
    p.add_argument("--no-run", action="store_true", help="build both ways only (no GPU needed)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    chosen = parse_models(args.models)
    if chosen is None:
        print(f"error: --models takes NAME:BATCH[:implicit],... | got {args.models!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is a file", file=sys.stderr)
        return 2
    base = next(p for p in (out, *out.parents) if p.exists())
    if not base.is_dir() or not os.access(base, os.W_OK):
        print(f"error: --out {out} cannot be written ({base} is not a writable folder)", file=sys.stderr)
        return 2

    import models
    from deploy import targets
    from deploy.errors import TargetError

    unknown = [m for m, _, _ in chosen if m not in models.names()]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)} (see models/)", file=sys.stderr)
        return 2
    run = not args.no_run
    try:
        target = targets.resolve(args.target or ("cuda" if run else "cuda:sm_90"))
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if target.kind != "cuda":
        print(f"error: --target must be a CUDA target | got {args.target!r}", file=sys.stderr)
        return 2
    from deploy.passes import mma_gemm

    if not mma_gemm.available(target.tvm_target()):
        print(f"error: --target {target.tvm_target().attrs.get('arch')}: the rule needs sm_80 or later (cp.async)",
              file=sys.stderr)
        return 2
    device = "not run"
    if run:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA GPU here to time on (--no-run builds only)", file=sys.stderr)
            return 2
        device = torch.cuda.get_device_name()
    meta = {"device": device, "target": str(target.tvm_target())}
    rows, bad = [], 0
    for name, batch, implicit in chosen:
        label = name + (" --implicit-gemm" if implicit else "")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                found = kernels(name, batch, implicit, target, Path(tmp))
            except Exception as e:  # noqa: BLE001 - the model's row says why; the others go on
                row = {"model": label, "bucket": str(batch), "kernel": "(the model)", "calls": 0, "gemm": "",
                       "config": "", "error": probe_common.error_line(e)}
                rows.append(row)
                bad += 1
                print(row, flush=True)
                write(out, meta, rows)
                continue
            for bucket, task, func, calls in found:
                try:
                    row = compare(func, target, run)
                except Exception as e:  # noqa: BLE001 - one kernel's failure is its row
                    row = {"gemm": "", "config": "", "error": probe_common.error_line(e)}
                if row is None:
                    continue
                row = {"model": label, "bucket": bucket, "kernel": task, "calls": calls, **row}
                bad += "error" in row or row.get("rel_l2", 0.0) > TOLERANCE
                rows.append(row)
                print(row, flush=True)
        write(out, meta, rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
