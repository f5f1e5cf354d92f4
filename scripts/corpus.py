"""The model corpus through the whole pipeline, untuned: which models build and
validate on a target, with what schedules and fallbacks, and how untuned TVM
at batch 1 (or --batch) compares with what a user already has, measured in the same run
(CPU: ONNX Runtime and PyTorch eager; GPU: PyTorch eager and torch.compile).
Beside each, whether plain TVM alone (from_onnx -> the "zero" pipeline ->
DLight's default rules -> tvm.compile, fp32) builds the same graph.

Answers in results/<machine>/<date>/corpus-<target>-<size>/ (corpus.md and
corpus.json), e.g. results/cpu/2026-12-01/corpus-llvm-full/ and
results/h200/2026-12-01/corpus-cuda-full/. Runs are resumable: models already
in the folder's corpus.json are skipped unless --force.

    python scripts/corpus.py --target llvm --out results/cpu/DATE/corpus-llvm-full
    python scripts/corpus.py --target cuda --precision fp16,fp32 --baselines --out results/h200/DATE/corpus-cuda-full
    python scripts/corpus.py --target cuda:sm_90 --size small --models convnext,bert   # cross-compile only
    python scripts/corpus.py --target cuda:sm_90 --batch 32 --out /tmp/c32   # the large-batch kernels
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

log = logging.getLogger("corpus")


def plain_tvm_builds(onnx_path: Path, inputs, target, batch: int = 1) -> str:
    """'ok' or the error line: TVM alone, with none of the pipeline's code,
    at `batch`."""
    from deploy.errors import error_line
    from deploy.export import load_onnx
    from deploy.tvm_compat import PassContext, dlight, from_onnx, relax, tvm

    try:
        model = load_onnx(onnx_path)
        mod = from_onnx(model, shape_dict={i.name: [batch, *i.shape] for i in inputs},
                        dtype_dict={i.name: i.dtype for i in inputs}, keep_params_in_input=False)
        tgt = target.tvm_target()
        with tgt, PassContext(opt_level=3):
            mod = relax.get_pipeline("zero")(mod)
            if target.kind == "cuda":
                g = dlight.gpu
                mod = dlight.ApplyDefaultSchedule(g.Matmul(), g.GEMV(), g.Reduction(), g.GeneralReduction(),
                                                  g.Fallback())(mod)
            tvm.compile(mod, target=tgt)
        return "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is the answer
        return error_line(e)


def baselines(name: str, size: str, target, precision: str, inputs_np, onnx_path: Path, iters: int,
              compile_precisions=("fp16",)) -> dict:
    """p50 (ms) of what a user could run instead, on the same inputs."""
    import models
    from deploy.bench import latency
    from deploy.bench import runners as bench

    def factory():
        return models.build(name, seed=0, size=size)

    runners = []
    if target.kind == "cuda":
        half = precision == "fp16"
        runners = [bench.TorchRunner("torch-eager", factory, half=half)]
        if precision in compile_precisions:
            runners.append(bench.TorchRunner("torch-compile", factory, half=half, compile_mode="default"))
    else:
        spec = models.get(name)
        runners = [bench.ORTRunner(onnx_path, [t.name for t in spec.sized(size).inputs]),
                   bench.TorchRunner("torch-eager", factory)]
    out = {}
    for r in runners:
        label = r.name if hasattr(r, "name") else r.kind
        try:
            t0 = time.time()
            r.activate(inputs_np)
            setup = time.time() - t0
            label = r.name
            n = bench.iterations_for(r, 3.0, iters)
            out[label] = {"p50_ms": bench.percentiles(r.time(max(1, n // 10), n), 1)["p50_ms"],
                          "setup_s": round(setup, 1), "iterations": n}
        except Exception as e:  # noqa: BLE001 - a runner that cannot run is recorded, not fatal
            out[label] = {"error": latency._failure(e)}
        finally:
            try:
                r.deactivate()
            except Exception:  # noqa: BLE001
                pass
    return out


def build_one(job) -> dict:
    """Export, import, optimize, build and validate one (model, precision),
    untuned, in `work`/<model>-<precision> (a process-pool entry)."""
    name, precision, size, exporter, target_name, work, plain, extra, batch = job
    import models
    from deploy import artifacts, config, pipeline, targets
    from deploy.errors import DeployError

    logging.basicConfig(level=logging.WARNING)
    target = targets.resolve(target_name)
    work = Path(work)
    spec = models.get(name)
    entry = {"model": name, "kind": spec.kind, "expect": spec.expect, "precision": precision,
             "size": size, "exporter": exporter}
    if precision != "fp16":  # (the wgmma kernel is fp16's; fp32 jobs of the same run build as before)
        extra = {k: v for k, v in extra.items() if k != "wgmma_gemm"}
    profile = {"buckets": [batch], "tune_buckets": [], "trials": 0, "precision": precision, **extra}
    cfg = config.from_dict({"model": {"source": name, "size": size, "exporter": exporter}, target.kind: profile})
    ws = work / f"{name}-{precision}"
    shutil.rmtree(ws, ignore_errors=True)
    t0 = time.time()
    try:
        summary = pipeline.run(cfg, target, ws, db_root=work / "no-databases", compare_untuned=False)
        entry["outcome"] = "validated" if summary["validation"] else "built"
        entry["stage_seconds"] = summary["stage_seconds"]
    except DeployError as e:
        entry["outcome"] = "unsupported" if type(e).__name__ == "UnsupportedOperatorError" else "failed"
        entry["error"] = str(e)[:400]
    except Exception as e:  # noqa: BLE001 - a bug: recorded with its trace, the run goes on
        entry["outcome"] = "failed"
        entry["error"] = f"BUG {type(e).__name__}: {e}"[:400]
        (work / f"{name}-{precision}.trace").write_text(traceback.format_exc())
    entry["seconds"] = round(time.time() - t0, 1)
    entry["workdir"] = str(ws)
    pkg = ws / "package"
    if (pkg / artifacts.MANIFEST).is_file():
        b = json.loads((pkg / artifacts.MANIFEST).read_text())["buckets"][str(batch)]
        entry["kernels"], entry["schedules"], entry["fallbacks"] = b["kernels"], b["schedules"], b["fallbacks"]
        entry["build_seconds"] = b["compile_seconds"]
    if entry["outcome"] == "validated":
        v = json.loads((pkg / "validation.json").read_text())
        entry["worst_rel_l2"] = max(r["rel_l2"] for refs in v["buckets"][str(batch)].values() for r in refs.values())
    if plain and (ws / "export" / "model.onnx").is_file():
        from deploy import export

        ex = export.load(ws / "export")
        entry["plain_tvm"] = plain_tvm_builds(ex.onnx_path, ex.inputs, target, batch)
    return entry


def time_one(entry: dict, args, target) -> None:
    """TVM's p50 at the run's batch and, with --baselines, the
    alternatives', in this process, one runner at a time."""
    from deploy import runtime
    from deploy.bench import runners as bench

    pkg = Path(entry["workdir"]) / "package"
    pred = runtime.load(pkg, warn_unvalidated=False)
    inputs = pred.random_inputs(args.batch, seed=0)
    r = bench.TVMRunner("tvm", pkg)
    r.activate(inputs)
    iters = bench.iterations_for(r, 3.0, args.iters)
    entry["tvm_p50_ms"] = bench.percentiles(r.time(max(1, iters // 10), iters), 1)["p50_ms"]
    r.deactivate()
    if args.baselines:
        entry["baselines"] = baselines(entry["model"], args.size, target, entry["precision"], inputs,
                                       Path(entry["workdir"]) / "export" / "model.onnx", args.iters,
                                       [p for p in args.compile_precisions.split(",") if p])


def markdown(report: dict) -> str:
    rows = report["results"]
    ok = sum(1 for r in rows if r["outcome"] in ("validated", "built"))
    exp = sum(1 for r in rows if r["expect"] != "build" and r["outcome"] == "unsupported")
    plain = [r for r in rows if "plain_tvm" in r]
    lines = [f"# Corpus, {report['target']} ({report['size']} size, {report['exporter']} exporter"
             + (f", batch {report['batch']}" if report.get("batch", 1) != 1 else "") + ")", "",
             f"Machine: {report['environment'].get('gpu') or report['environment'].get('cpu', '?')}; "
             f"{report['date']}; " + ("commands (one run, resumed): " if len(report.get("commands", [])) > 1 else "command: ")
             + "; ".join(f"`{c}`" for c in report.get("commands") or [report["command"]]), "",
             f"{ok} of {len(rows)} runs built" + (" and validated" if any(r['outcome'] == 'validated' for r in rows) else "")
             + f"; {exp} expected unsupported-operator errors"
             + (f"; plain TVM built {sum(1 for r in plain if r['plain_tvm'] == 'ok')} of {len(plain)}" if plain else ""),
             ""]
    base_names = sorted({k for r in rows for k in (r.get("baselines") or {})})
    head = ["model", "kind", "precision", "outcome", "kernels", "fallbacks", "build s", "rel_l2", "TVM p50 ms"]
    head += [f"{b} p50 ms" for b in base_names] + (["plain TVM"] if plain else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fb = r.get("fallbacks") or []
        cells = [r["model"], r["kind"], r["precision"],
                 r["outcome"] + (f": {r['error'][:90]}" if r.get("error") else ""),
                 str(r.get("kernels", "")), str(len(fb)) if "fallbacks" in r else "",
                 f"{r['build_seconds']:.1f}" if "build_seconds" in r else "",
                 f"{r['worst_rel_l2']:.1e}" if "worst_rel_l2" in r else "",
                 f"{r['tvm_p50_ms']:.3f}" if "tvm_p50_ms" in r else ""]
        for b in base_names:
            v = (r.get("baselines") or {}).get(b, {})
            cells.append(f"{v['p50_ms']:.3f}" if "p50_ms" in v else ("n/a" if v else ""))
        if plain:
            cells.append("" if "plain_tvm" not in r else ("ok" if r["plain_tvm"] == "ok" else "fails"))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    falls = [(r["model"], r["precision"], f) for r in rows for f in r.get("fallbacks") or []]
    if falls:
        lines += ["", "## Fallbacks", ""]
        lines += [f"- {m} {p}: kernel `{f['kernel']}` -> {f['to']} (from {', '.join(f['from'])}: {f['reasons'][-1][:160]})"
                  for m, p, f in falls]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--size", default="full", choices=("full", "small"))
    ap.add_argument("--exporter", default="torchscript", choices=("torchscript", "dynamo"))
    ap.add_argument("--precision", default="", help="comma list (default: fp32 on llvm, fp16 on cuda)")
    ap.add_argument("--models", default="", help="comma list (default: the whole registry)")
    ap.add_argument("--layout", default="", help="the convolutions' layout (default: the target's, see deploy/config.py)")
    ap.add_argument("--flat-gemm", action="store_true", help="the profile's flat_gemm (passes/flat_gemm.py)")
    ap.add_argument("--implicit-gemm", action="store_true",
                    help="the profile's implicit_gemm (passes/implicit_gemm.py; NHWC: on llvm with --layout NHWC)")
    ap.add_argument("--batch", type=int, default=1, help="the images (or sequences) a model runs on at once")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--baselines", action="store_true", help="time the alternatives in the same run")
    ap.add_argument("--compile-precisions", default="fp16",
                    help="precisions torch.compile is timed at with --baselines (its compile takes ~30 s a model)")
    ap.add_argument("--plain-tvm", action="store_true", help="also try TVM alone on each graph")
    ap.add_argument("--force", action="store_true", help="re-run models already in corpus.json")
    ap.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=None,
                    help="the profile's fused_attention (passes/attention.py; CUDA only, on by default for fp16)")
    ap.add_argument("--wgmma-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="the profile's wgmma_gemm (passes/wgmma_gemm.py; CUDA only, on by default for fp16, "
                         "taken on sm_90)")
    ap.add_argument("--work", default="", help="keep each model's workdir here (timing resumes from it)")
    ap.add_argument("--jobs", type=int, default=1, help="models built in parallel (timing is always one at a time)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import models
    from deploy import artifacts, targets
    from deploy.bench import report as bench_report

    if args.batch < 1:
        print(f"error: --batch {args.batch} is not a batch | expected a positive integer", file=sys.stderr)
        return 2
    target = targets.resolve(args.target)
    if args.flat_gemm and target.kind == "llvm" and args.layout != "NHWC":
        print("error: --flat-gemm on llvm needs --layout NHWC (the CPU's default layout is NCHWc)", file=sys.stderr)
        return 2
    if args.implicit_gemm and (args.layout or ("NCHWc" if target.kind == "llvm" else "NHWC")) != "NHWC":
        print(f"error: --implicit-gemm needs the NHWC layout | got {args.layout or 'the CPU default, NCHWc'} "
              "| expected --layout NHWC (the default on cuda)", file=sys.stderr)
        return 2
    for flag, given in (("--fused-attention", args.fused_attention), ("--wgmma-gemm", args.wgmma_gemm)):
        if given and target.kind != "cuda":
            print(f"error: {flag} is a CUDA option | got --target {args.target} | expected a cuda target",
                  file=sys.stderr)
            return 2
    names = [n.strip() for n in args.models.split(",") if n.strip()] or models.names()
    unknown = [n for n in names if n not in models.names()]
    if unknown:
        print(f"error: unknown model '{unknown[0]}' | known: {', '.join(models.names())}", file=sys.stderr)
        return 2
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()] or \
        (["fp16"] if target.kind == "cuda" else ["fp32"])
    out = Path(args.out)
    path = out / "corpus.json"
    report = json.loads(path.read_text()) if path.is_file() else {"results": []}
    settings = {"target": target.key()["kind"] + " " + target.arch, "size": args.size, "exporter": args.exporter,
                "layout": args.layout or "default", "flat_gemm": args.flat_gemm,
                "implicit_gemm": args.implicit_gemm, "fused_attention": args.fused_attention,
                "wgmma_gemm": args.wgmma_gemm, "batch": args.batch}
    # A resumed run adds rows to the saved ones: only under the same settings (a saved corpus from before
    # `wgmma_gemm` existed was built with it off, as `false` says now; CUDA's options mean nothing on llvm)
    saved = {k: report.get(k, {"wgmma_gemm": False, "batch": 1}.get(k, v)) for k, v in settings.items()}
    differ = [k for k in settings if saved[k] != settings[k]
              and not (target.kind != "cuda" and k in ("fused_attention", "wgmma_gemm"))]
    if report["results"] and not args.force and differ:
        k = differ[0]
        print(f"error: {path} was made with other settings | got {k} {json.dumps(settings[k])}, it has "
              f"{json.dumps(saved[k])} | expected another --out, or --force to run every model again", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    env = bench_report.environment()
    command = "python scripts/corpus.py " + " ".join(argv if argv is not None else sys.argv[1:])
    # A resumed run is several commands: each is kept, in order.
    commands = report.get("commands") or ([report["command"]] if "command" in report else [])
    report.update({**settings, "date": time.strftime("%Y-%m-%d"), "environment": env, "command": command,
                   "commands": [*commands, command]})
    # (with --force under other settings, the saved rows go: none of them was built as the header now says)
    results = {} if differ else {(r["model"], r["precision"]): r for r in report["results"]}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="corpus-"))
    work.mkdir(parents=True, exist_ok=True)

    def save():
        report["results"] = list(results.values())
        artifacts.write_json_atomic(path, report)  # after every model: a killed run keeps what it did

    extra = {**({"layout": args.layout} if args.layout else {}), **({"flat_gemm": True} if args.flat_gemm else {}),
             **({"implicit_gemm": True} if args.implicit_gemm else {}),
             **({"fused_attention": args.fused_attention} if args.fused_attention is not None else {}),
             **({"wgmma_gemm": args.wgmma_gemm} if args.wgmma_gemm is not None else {})}
    jobs = [(n, p, args.size, args.exporter, args.target, str(work), args.plain_tvm, extra, args.batch)
            for n in names for p in precisions if args.force or (n, p) not in results]
    try:
        if jobs:
            import concurrent.futures
            import multiprocessing

            with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs),
                                                        mp_context=multiprocessing.get_context("spawn")) as pool:
                futs = {pool.submit(build_one, j): j for j in jobs}
                for f in concurrent.futures.as_completed(futs):
                    e = f.result()
                    results[(e["model"], e["precision"])] = e
                    save()
                    print(f"{e['model']:18s} {e['precision']}  {e['outcome']:11s} {e['seconds']:6.1f} s"
                          + (f"  {e.get('error', '')[:140]}" if e.get("error") else ""), flush=True)
        if target.has_device:
            for key in [(n, p) for n in names for p in precisions]:
                e = results.get(key)
                if not e or e["outcome"] != "validated" or ("tvm_p50_ms" in e and (e.get("baselines") or not args.baselines)):
                    continue
                if not (Path(e["workdir"]) / "package").is_dir():
                    continue  # built in an earlier run whose workdir is gone
                t0 = time.time()
                time_one(e, args, target)
                save()
                print(f"{e['model']:18s} {e['precision']}  timed in {time.time() - t0:5.1f} s: TVM p50 {e['tvm_p50_ms']:.3f} ms  "
                      + "  ".join(f"{k} {v['p50_ms']:.3f}" if "p50_ms" in v else f"{k} n/a"
                                  for k, v in (e.get("baselines") or {}).items()), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    order = {n: i for i, n in enumerate(models.names())}
    report["results"] = sorted(results.values(), key=lambda r: (order.get(r["model"], 999), r["precision"]))
    artifacts.write_json_atomic(path, report)
    (out / "corpus.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
