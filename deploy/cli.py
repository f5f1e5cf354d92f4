"""Command line: `python -m deploy <command>` (also installed as `tvm-deploy`).

  run        the whole pipeline (what `make tune` calls)
  export     frontend  optimize  tune  build  validate   one stage each
  profile    per-kernel times of one bucket (after build)
  info       print a package's manifest summary
  doctor     check this machine (GPU, driver, CUDA toolkit, pins, databases,
             a package with --package): OK / WARN / FAIL rows, exit 1 on a FAIL
  serve      serve a package over HTTP (Open Inference Protocol / KServe v2)
  loadtest   throughput and latency of the server against the raw module
  rpc-tracker, rpc-server, rpc-status
             TVM's RPC tracker and servers, to tune on a pool of GPUs
             (`run`/`tune --tracker HOST:PORT --rpc-key KEY`)

A user error prints one line ("error: what | got ... | expected ...") and
exits 2; a finished run prints `PASSED | <seconds>s | <command>`.

Longer than ~500 lines on purpose: the whole command-line surface (13
commands, the flags they share, their thin handlers) is one module, so a flag
is defined and read in one place and `--help` matches the code beside it.
The work itself is in the stages and wings each handler calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import sys
import time
from pathlib import Path

from . import config as config_mod
from .errors import ConfigError, DeployError

log = logging.getLogger("deploy")
STAGES = ("export", "frontend", "optimize", "tune", "build", "validate", "profile")


def _input_spec(text: str) -> config_mod.InputSpec:
    """NAME:3x224x224[:dtype] (the per-sample shape, batch excluded)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ConfigError("invalid --input", repr(text), "NAME:3x224x224[:float32]")
    try:
        shape = tuple(int(d) for d in parts[1].lower().split("x"))
    except ValueError:
        raise ConfigError("invalid --input shape", repr(parts[1]), "dims like 3x224x224") from None
    table = {"name": parts[0], "shape": list(shape)}
    if len(parts) == 3:
        table["dtype"] = parts[2]
    return config_mod._build(config_mod.InputSpec, table, "--input")


def resolve_config(args) -> config_mod.Config:
    """--model is a registry name, a config name under configs/, a .toml file
    or an .onnx file; --config points at a .toml explicitly."""
    from .artifacts import REPO_ROOT

    model = args.model
    if args.config:
        cfg = config_mod.load(args.config)
    elif model.endswith(".toml"):
        cfg = config_mod.load(model)
    elif model.endswith(".onnx"):
        if not Path(model).is_file():
            raise ConfigError("ONNX file not found", model)
        cfg = config_mod.from_dict({"model": {"source": model}})
    else:
        path = REPO_ROOT / "configs" / f"{model}.toml"
        if path.is_file():
            cfg = config_mod.load(path)
        else:
            import models

            if model not in models.names():
                raise ConfigError(
                    f"unknown model '{model}'{config_mod._suggest(model, models.names())}",
                    None,
                    "a registry name (" + ", ".join(models.names()) + "), a .toml config or an .onnx file",
                )
            cfg = config_mod.from_dict({"model": {"source": model}})
    changes = {}
    if args.input:
        changes["inputs"] = tuple(_input_spec(t) for t in args.input)
    if args.checkpoint:
        changes["checkpoint"] = args.checkpoint
    if args.seed is not None:
        changes["seed"] = args.seed
    if changes:
        import dataclasses

        table = dataclasses.asdict(cfg.model)
        table.update({k: v if k != "inputs" else [dataclasses.asdict(i) for i in v] for k, v in changes.items()})
        cfg = dataclasses.replace(cfg, model=config_mod._build(config_mod.ModelConfig, table, "model"))
    return cfg


def _nonempty(text: str | None) -> str | None:
    return text if text not in (None, "") else None


def prepare(args):
    from . import targets
    from .pipeline import DEFAULT_DB_ROOT, default_workdir

    cfg = resolve_config(args)
    tracker, key = getattr(args, "tracker", None), getattr(args, "rpc_key", None)
    lanes, lane_cpus = getattr(args, "rpc_lanes", None), getattr(args, "rpc_lane_cpus", None)
    config_mod.check_lanes(lanes, lane_cpus)
    # --rpc-lanes N (2 or more) without a tracker: N lanes on this machine's
    # device through a loopback pool (see _loopback).
    args.loopback = (lanes, lane_cpus or 0) if (lanes or 0) > 1 and not tracker and not key else None
    pool = config_mod.rpc_pool(tracker, key, *((None, None) if args.loopback else (lanes, lane_cpus)))
    if pool is not None:
        from .tuning import devices as rpc_devices

        # Measured on the pool: `auto`/`cuda` is the pool's GPU, read from it.
        target = rpc_devices.resolve_target(_nonempty(args.target) or "auto", pool)
    else:
        target = targets.resolve(_nonempty(args.target) or "auto")
    args.pool = pool
    if lanes is None and pool is None and target.kind == "cuda" and target.has_device:
        from .tuning.builder import usable_cpus

        if usable_cpus() >= config_mod.LOCAL_LANES_MIN_CPUS:
            args.loopback = (config_mod.LOCAL_LANES, lane_cpus or 0)  # started only when the run tunes (_loopback)
    buckets = config_mod.parse_int_list(args.buckets, "--buckets") if _nonempty(args.buckets) else None
    tune_buckets = config_mod.parse_int_list(args.tune_buckets, "--tune-buckets") if _nonempty(args.tune_buckets) else None
    cfg = config_mod.apply_overrides(
        cfg,
        target.kind,
        precision=_nonempty(args.precision),
        layout=_nonempty(args.layout),
        accumulate=_nonempty(args.accumulate),
        buckets=list(buckets) if buckets else None,
        tune_buckets=list(tune_buckets) if tune_buckets else None,
        trials=args.trials,
        trials_per_task=args.trials_per_task,
        max_tasks=args.max_tasks,
        split_k=getattr(args, "split_k", None),
        flat_gemm=getattr(args, "flat_gemm", None),
        pad_gemm=getattr(args, "pad_gemm", None),
        implicit_gemm=getattr(args, "implicit_gemm", None),
        fused_attention=getattr(args, "fused_attention", None),
        wgmma_gemm=getattr(args, "wgmma_gemm", None),
        budget=args.budget,
    )
    if _nonempty(getattr(args, "dim_buckets", None)):
        if not cfg.model.dims:
            raise ConfigError("--dim-buckets for a model without dimensions besides the batch", args.dim_buckets,
                              "[[model.dims]] in the model's config (docs/shapes.md)")
        dims = config_mod.parse_dim_buckets(args.dim_buckets, cfg.model.dims)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dims=dims))
    workdir = Path(args.workdir) if args.workdir else default_workdir(cfg, target)
    db_root = Path(args.db_root) if args.db_root else DEFAULT_DB_ROOT
    return cfg, target, workdir, db_root


def _check_pool(args, target, profile) -> None:
    """Before any work: every server of the pool has the target's device."""
    from .tuning import pool as rpc_pool

    if args.pool is not None and not isinstance(args.pool, rpc_pool.LazyLoopback) \
            and profile.trials > 0 and profile.tune_buckets:
        from .tuning import devices as rpc_devices

        rpc_devices.check_pool(args.pool, target)


@contextlib.contextmanager
def _loopback(args, target, profile, workdir: Path):
    """With --rpc-lanes N and no tracker, while the block runs: a loopback
    pool on this machine's device as args.pool (a tuning.pool.LazyLoopback:
    the tune stage starts it once a database has trials left to tune; it
    is stopped when the block ends), only when tuning is asked for on a
    device here."""
    if args.loopback is None:
        yield
        return
    if not (profile.trials > 0 and profile.tune_buckets and target.has_device):
        log.info("--rpc-lanes: no tuning on a %s device here, so no lanes are started", target.kind)
        yield
        return
    from .tuning import pool as rpc_pool

    lanes, lane_cpus = args.loopback
    log.info("tune: %d lanes on this machine's %s through a loopback pool, started when there is tuning to do "
             "(--rpc-lanes 1: one process)", lanes, target.kind)
    if target.kind == "llvm":
        log.warning("--rpc-lanes on the CPU target: a lane's candidates are timed on the same cores that the other "
                    "lanes search and build on, so CPU timings will be noisy")
    args.pool = rpc_pool.LazyLoopback(lanes, lane_cpus, workdir / "rpc-loopback")
    try:
        yield
    finally:
        args.pool.close()
        args.pool = None


def _alternatives(text: str) -> tuple[str, ...]:
    from .bench.latency import check_alternatives

    names = tuple(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    check_alternatives(names)
    return names


def cmd_run(args) -> int:
    from . import pipeline

    alternatives = _alternatives(args.alternatives)  # before any work
    cfg, target, workdir, db_root = prepare(args)
    profile = cfg.profile(target.kind)
    with _loopback(args, target, profile, workdir):
        print(pipeline.describe(cfg, target, workdir, db_root, profile.budget, args.pool), flush=True)
        _check_pool(args, target, profile)
        summary = pipeline.run(cfg, target, workdir, db_root, dump_ir=args.dump_ir, pool=args.pool,
                               compare_untuned=False if args.no_untuned else (True if args.untuned else None),
                               alternatives=alternatives)
    print(pipeline.format_summary(summary), flush=True)
    return 0


def cmd_stage(args) -> int:
    from .pipeline import Workspace, stage_guard

    cfg, target, workdir, db_root = prepare(args)
    profile = cfg.profile(target.kind)
    ws = Workspace(workdir)
    with stage_guard(workdir, args.command):
        return _run_stage(args, cfg, target, workdir, db_root, profile, ws)


def _same_dims(cfg, ws) -> None:
    """A stage after export works on the lengths the export stage recorded:
    other ones asked for now (--dim-buckets, an edited config) are refused."""
    from . import artifacts, export

    if (ws.export / artifacts.MANIFEST).is_file() and export.load(ws.export).dims != cfg.model.dims:
        raise ConfigError("the dimensions' lengths differ from those the export stage recorded",
                          ", ".join(f"{d.name}={','.join(map(str, d.buckets))}" for d in export.load(ws.export).dims),
                          "the same lengths, or the export stage (and those after it) run again with the new ones")


def _run_stage(args, cfg, target, workdir, db_root, profile, ws) -> int:
    from . import build, export, frontend, optimize, shapes, validate
    from .pipeline import existing_databases, tuned_direct

    if args.command != "export":
        _same_dims(cfg, ws)
    from .tuning import tune

    stage = args.command
    if stage == "export":
        a = export.run(cfg, ws.export)
        print(f"export: {a.onnx_path}")
    elif stage == "frontend":
        a = frontend.run(profile, export.load(ws.export), ws.frontend)
        print(f"frontend: {len(a.modules)} bucket module(s) in {a.folder}")
    elif stage == "optimize":
        ex = export.load(ws.export)
        a = optimize.run(profile, target, frontend.load(ws.frontend, ex), ws.optimize, dump_ir=args.dump_ir,
                         tuned_direct=tuned_direct(cfg, profile, target, ex.inputs, db_root, ex.dims))
        for b, rep in a.manifest["report"].items():
            print(f"optimize b{b}: {optimize.summarize(rep)}")
    elif stage == "tune":
        ex = export.load(ws.export)
        with _loopback(args, target, profile, workdir):
            a = tune.run(profile, target, optimize.load(ws.optimize), cfg.model.name, ex.inputs, db_root, ws.tune,
                         config_mod.parse_duration(profile.budget), cfg.model.seed, args.pool, ex.dims)
        print(f"tune: databases {', '.join(map(str, a.databases.values()))}")
        for reason, n in tune.failure_reasons(a.folder):
            print(f"  {n:5d} x {reason}")
    elif stage == "build":
        ex = export.load(ws.export)
        keys, existing = existing_databases(cfg, profile, target, ex.inputs, db_root, ex.dims)
        a = build.run(profile, target, ex, optimize.load(ws.optimize), existing, keys, ws.package, cfg.model.name,
                      db_root)  # (the kernel store under the databases' root, as `deploy run` applies it)
        print(f"build: package {a.folder}")
    elif stage == "profile":
        from .bench import profile as profile_mod

        ex = export.load(ws.export)
        built = ex.buckets(profile)
        if args.bucket is not None:
            bucket = shapes.parse(args.bucket)
        else:
            bucket = next(b for b in built if b.batch == (profile.tune_buckets or profile.buckets)[0])
        if bucket not in built:
            raise ConfigError("--bucket is not one of the built buckets", bucket.label, [b.label for b in built])
        keys, existing = existing_databases(cfg, profile, target, ex.inputs, db_root, ex.dims)
        db = (existing[bucket], keys[bucket]) if bucket in existing else None
        rep = profile_mod.run(profile, target, optimize.load(ws.optimize), db, bucket, ws.profile, iters=args.iters,
                              trace=Path(args.trace) if args.trace else None, debug_kernels=args.debug_kernels)
        print(profile_mod.format_report(rep, top=15), end="")
        if args.trace:
            print(f"profile: timeline {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
        print(f"profile: full report in {ws.profile / 'profile.md'}")
    elif stage == "validate":
        rep = validate.run(cfg, getattr(cfg.tolerance, profile.precision), ws.package, export.load(ws.export), cfg.model.seed)
        print(f"validate: passed, worst rel_l2 {rep['worst_rel_l2']:.1e}")
    return 0


def cmd_bench(args) -> int:
    import tempfile

    from . import export
    from .bench import latency, trtexec
    from .bench import report as bench_report
    from .export import is_onnx_source
    from .pipeline import Workspace

    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("invalid --iters/--warmup", f"{args.iters}/{args.warmup}", "iters >= 1 and warmup >= 0")
    if args.rounds is None:
        args.rounds = min(5, args.iters)
    latency.check_rounds(args.rounds, args.iters)  # before the set-up, not after it
    cfg, target, workdir, db_root = prepare(args)
    profile = cfg.profile(target.kind)
    ws = Workspace(workdir)
    ex = export.load(ws.export)
    _same_dims(cfg, ws)
    names = tuple(n.strip() for n in args.runners.split(",") if n.strip())
    factory = None
    if not is_onnx_source(cfg.model.source):
        factory = lambda: export.build_torch_model(cfg)  # noqa: E731
    for b in args.baseline or []:
        if trtexec.baseline_batch(Path(b)) not in profile.buckets:
            raise ConfigError(f"baseline {b} is for a batch that is not benchmarked", trtexec.baseline_batch(Path(b)),
                              list(profile.buckets))
    report = {"model": cfg.model.name, "target": target.key(), "environment": bench_report.environment(), "cases": [],
              "command": args.command_line}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        report["cases"] = latency.cases(cfg, profile, ws, ex, names, factory, Path(tmp), baselines=args.baseline or [],
                                        warmup=args.warmup, iters=args.iters, rounds=args.rounds,
                                        compile_mode=args.compile_mode)
    out = Path(args.out) if args.out else ws.bench
    bench_report.write(report, out)
    print(bench_report.markdown(report), end="")
    print(f"bench: {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")
    return 0


def cmd_info(args) -> int:
    import json

    from . import runtime

    m = runtime.check_package(args.package)
    print(json.dumps({k: m[k] for k in ("model", "inputs", "outputs", "precision", "target", "gpu", "buckets", "validation", "versions")}, indent=2))
    need = runtime.device_memory(m)
    for label, b in m["buckets"].items():
        if b.get("memory"):
            print(f"bucket {label}: weights {b['memory']['weights_bytes'] / 2**20:,.1f} MiB, "
                  f"workspace {b['memory']['workspace_bytes'] / 2**20:,.1f} MiB")
    if need is not None:
        print(f"device memory once loaded: {need / 2**20:,.1f} MiB (every bucket's module holds its own weights)")
    return 0


def cmd_doctor(args) -> int:
    import json

    from . import doctor

    rows = doctor.run(args.package)
    if args.json:  # stdout holds the JSON alone (no status line after it), for scripts
        print(json.dumps(doctor.as_json(rows), indent=2), flush=True)
        sys.exit(doctor.exit_code(rows))
    print(doctor.table(rows), flush=True)
    return doctor.exit_code(rows)


def cmd_pack_databases(args) -> int:
    """Fold what killed tuning runs left (working copies, journals, lanes)
    into the compressed database files, for every database under a root;
    then rebuild each GPU's kernel store from them."""
    from .tuning import database
    from .tuning import store as kernel_store

    root = Path(args.root)
    if not root.is_dir():
        raise ConfigError("tuning database root not found", str(root), "an existing folder (e.g. tuning_logs)")
    # A tuning lane's folder is folded into its database (which it may precede).
    folders = {database.lane_owner(k.parent) or k.parent for k in root.rglob(database.KEY_FILE)
               if k.relative_to(root).parts[0] != kernel_store.STORE}
    for folder in sorted(folders):
        added = database.pack(folder)
        print(f"{folder}: {added} record(s) folded in" if added else f"{folder}: packed")
    for dest, n in sorted(kernel_store.refresh(root).items()):
        print(f"{dest}: kernel store, the best record of {n} kernels")
    return 0


def resolve_package(args) -> Path:
    """--package, or the package in the default workdir of -m MODEL (with
    --target/--precision/--workdir, as the other commands find it)."""
    from . import targets
    from .pipeline import default_workdir

    if args.package:
        return Path(args.package)
    if not args.model:
        raise ConfigError("no package given", None, "--package FOLDER, or -m MODEL to use its default workdir")
    cfg = resolve_config(args)
    if args.workdir:
        return Path(args.workdir) / "package"
    target = targets.resolve(_nonempty(args.target) or "auto")
    cfg = config_mod.apply_overrides(cfg, target.kind, precision=_nonempty(args.precision))
    return default_workdir(cfg, target) / "package"


def _serve_config(args, base: config_mod.ServeConfig) -> config_mod.ServeConfig:
    return config_mod.serve_config(
        base, host=args.host, port=args.port, model_name=args.model_name, max_queue_delay_ms=args.max_queue_delay_ms,
        timeout_s=args.timeout_s, max_concurrency=args.max_concurrency, max_body_mb=args.max_body_mb,
        max_inflight_mb=args.max_inflight_mb, shutdown_grace_s=args.shutdown_grace_s, warmup=False if args.no_warmup else None,
        shared_memory=True if args.shared_memory else None, gil_switch_ms=args.gil_switch_ms,
    )


def cmd_serve(args) -> int:
    import dataclasses
    import json

    from .serving import serve

    folder = resolve_package(args)
    cfg = _serve_config(args, config_mod.ServeConfig())
    print(f"package    {folder}\nserve      {json.dumps(dataclasses.asdict(cfg))}", flush=True)
    return serve.run(cfg, folder)


def cmd_loadtest(args) -> int:
    import dataclasses
    import json

    from . import artifacts, runtime
    from .serving import loadtest

    folder = resolve_package(args)
    cfg = config_mod.loadtest_config(
        _serve_config(args, config_mod.LoadtestConfig().serve),
        concurrency=config_mod.parse_int_list(args.concurrency, "--concurrency") if args.concurrency else None,
        duration_s=args.duration_s, warmup_s=args.warmup_s, request_batch=args.request_batch,
        client_procs=args.client_procs, raw_seconds=args.raw_seconds,
    )
    # loadtest.run checks the package (every module's sha256): only its name here.
    out = Path(args.out) if args.out else loadtest.default_out(
        artifacts.read_manifest(folder, runtime.PACKAGE_STAGE, verify=False))
    print(f"package    {folder}\nloadtest   {json.dumps(dataclasses.asdict(cfg))}\nresults    {out}", flush=True)
    report = loadtest.run(cfg, folder, out, args.command_line)
    print(loadtest.markdown(report), end="")
    print(f"loadtest: {out / 'results.json'}, {out / 'results.md'}")
    return 0


def _add_package(p: argparse.ArgumentParser, d: config_mod.ServeConfig) -> None:
    p.add_argument("--package", help="package folder (default: the package in the workdir of --model)")
    p.add_argument("-m", "--model", help="registry name, configs/<name>.toml, a .toml or an .onnx file")
    p.add_argument("--config", help="config file (overrides the one found from --model)")
    p.add_argument("--target", default="", help="auto (default), llvm, cuda, or cuda:sm_XY")
    p.add_argument("--precision", default="", help="fp32, tf32 (CUDA: fp32 with TF32 tensor cores) or fp16")
    p.add_argument("--workdir", help="artifact folder (default artifacts/<model>/<target>-<precision>)")
    p.set_defaults(input=None, checkpoint=None, seed=None)
    # Defaults live in config.ServeConfig (`d`): None here means "not given".
    p.add_argument("--host", help=f"address to listen on (default {d.host}; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, help=f"port (default {d.port}; 0 picks a free one)")
    p.add_argument("--model-name", help="the model's name in URLs (default: the package's model name)")
    p.add_argument("--max-queue-delay-ms", type=float, help=f"how long a batch waits for more requests (default {d.max_queue_delay_ms:g})")
    p.add_argument("--timeout-s", type=float, help=f"per-request timeout: 504 after it (default {d.timeout_s:g})")
    p.add_argument("--max-concurrency", type=int, help=f"inference requests in flight; more get 503 (default {d.max_concurrency})")
    p.add_argument("--max-body-mb", type=float, help=f"largest request body; more gets 413 (default {d.max_body_mb:g})")
    p.add_argument("--max-inflight-mb", type=float,
                   help=f"request bodies held at once, in total; more gets 503 (default {d.max_inflight_mb:g})")
    p.add_argument("--shutdown-grace-s", type=float, help=f"on SIGTERM, how long in-flight requests may take (default {d.shutdown_grace_s:g})")
    p.add_argument("--no-warmup", action="store_true", help="report ready without running every bucket once")
    p.add_argument("--gil-switch-ms", type=float,
                   help=f"Python's GIL switch interval in the server (default {d.gil_switch_ms:g}; Python's own: 5)")
    p.add_argument("--shared-memory", action="store_true",
                   help="accept tensors in system shared memory (Triton's extension; for clients on this host: "
                        "any of them may then read or write this host's shared-memory objects)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="registry name, configs/<name>.toml, a .toml or an .onnx file")
    p.add_argument("--config", help="config file (overrides the one found from --model)")
    p.add_argument("--target", default="", help="auto (default), llvm, cuda, or cuda:sm_XY to cross-compile")
    p.add_argument("--precision", default="", help="fp32, tf32 (CUDA: fp32 with TF32 tensor cores) or fp16")
    p.add_argument("--layout", default="", help="NCHW, NHWC, or NCHWc (the CPU's default: channels blocked in 16s)")
    p.add_argument("--accumulate", default="", help="fp32 or fp16: accumulator dtype of fp16 convolutions/matmuls")
    p.add_argument("--buckets", default="", help="batch buckets, e.g. 1,8,32")
    p.add_argument("--tune-buckets", default="", help="buckets to tune, e.g. 1")
    p.add_argument("--dim-buckets", default="",
                   help="lengths of a dimension the config declares ([[model.dims]]), e.g. seq=64,128,256")
    p.add_argument("--trials", type=int, help="trials a tuned bucket's database should hold: tunes only what it lacks (0: no tuning)")
    p.add_argument("--trials-per-task", type=int)
    p.add_argument("--max-tasks", type=int, help="tune only the N heaviest tasks (0: all)")
    p.add_argument("--split-k", type=int,
                   help="split the reduction of small-row NHWC convolutions in N parts (batched matmul + sum; 0: off)")
    p.add_argument("--flat-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="1x1 NHWC convolutions and batched-row matmuls as 2-D GEMMs with their epilogues "
                        "(candidates for the mma.sync tensor-core rule; changes the kernels to tune)")
    p.add_argument("--implicit-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC convolutions with kernels larger than 1x1 as implicit GEMMs with their epilogues "
                        "(candidates for the mma.sync GEMM schedules; changes the kernels to tune; by default on "
                        "sm_90 in fp16 where no database was tuned on direct ones, the 1x1 ones as 2-D GEMMs too, "
                        "for the wgmma kernel)")
    p.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="attention (QK^T, softmax, PV and the layout operators around them) as one kernel "
                        "(CUDA, fp16; changes those kernels)")
    p.add_argument("--wgmma-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="fp16 GEMM kernels as our Hopper wgmma kernel (TMA, warp-specialized, persistent) before "
                        "their schedules and tuning records, and not tuned (CUDA sm_90; on by default in fp16, "
                        "for GEMMs and implicit GEMMs, whose A it gathers)")
    p.add_argument("--pad-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="pad GEMM rows whose count tiles badly to a multiple of 128 inside the kernel "
                        "(on by default for CUDA; changes those kernels)")
    p.add_argument("--budget", help="wall-clock tuning budget, e.g. 10m; '' for none")
    p.add_argument("--input", action="append", help="NAME:3x224x224[:dtype] for ONNX models (repeatable)")
    p.add_argument("--checkpoint", help="PyTorch state_dict for a registry model")
    p.add_argument("--seed", type=int, help="weight and input seed")
    p.add_argument("--workdir", help="artifact folder (default artifacts/<model>/<target>-<precision>)")
    p.add_argument("--db-root", help="tuning database root (default tuning_logs/)")
    p.add_argument("--dump-ir", action="store_true", help="write the IR after each optimization phase")


def _add_pool(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", help="HOST:PORT of a TVM RPC tracker: measure candidates on its servers (with --rpc-key)")
    p.add_argument("--rpc-key", help="the key the RPC servers registered under (one server per GPU)")
    p.add_argument("--rpc-lanes", type=int,
                   help="tuning processes sharing this machine's CPUs, each over a share of the tasks (default: one per "
                        "server); 2 or more without --tracker: that many on this machine's device, through a loopback "
                        f"tracker and server (default on a local GPU with {config_mod.LOCAL_LANES_MIN_CPUS}+ CPUs: "
                        f"{config_mod.LOCAL_LANES}; 1 for one process)")
    p.add_argument("--rpc-lane-cpus", type=int,
                   help="CPUs each tuning process uses (default: this machine's CPUs divided among them; "
                        "more lets one search or build while another waits)")


def cmd_rpc_tracker(args) -> int:
    import os

    from .tuning import pool as rpc_pool

    rpc_pool.check_port_free(args.host, args.port, "RPC tracker")
    cmd = rpc_pool.tracker_command(args.host, args.port)
    print(f"rpc-tracker {args.host}:{args.port}: {shlex.join(cmd)}", flush=True)
    os.execv(cmd[0], cmd)  # the tracker is TVM's; Ctrl-C stops it


def cmd_rpc_server(args) -> int:
    import os

    from .tuning import devices as rpc_devices
    from .tuning import pool as rpc_pool

    pool = config_mod.rpc_pool(args.tracker, args.key)
    if pool is None:
        raise ConfigError("rpc-server needs --tracker and --key")
    rpc_pool.check_server_address(args.host, pool.host)
    rpc_devices.connect(pool).close()  # the tracker is up (TVM's server would retry for a minute, then die)
    cmd = rpc_pool.server_command(pool.address, pool.key, args.host, args.port, args.port_end or args.port + 100, args.custom_addr)
    gpu = f"CUDA_VISIBLE_DEVICES={args.gpu} " if args.gpu is not None else ""
    print(f"rpc-server under key '{pool.key}' at tracker {pool.address}: {gpu}{shlex.join(cmd)}", flush=True)
    os.environ.update(rpc_pool.server_env(args.gpu))
    # TVM's server (what that command runs), watched: exits 1 when it stops
    # listening (a candidate that crashes its session can end TVM's listen
    # thread, leaving the process up but gone from the tracker).
    return rpc_pool.serve_watched(pool, args.host, args.port, args.port_end or args.port + 100, args.custom_addr)


def cmd_rpc_status(args) -> int:
    from .tuning import devices as rpc_devices

    pool = config_mod.rpc_pool(args.tracker, args.rpc_key)
    if pool is None:
        raise ConfigError("rpc-status needs --tracker and --rpc-key")
    found = rpc_devices.probe_pool(pool)
    print(f"tracker    {pool.address}, key '{pool.key}': {len(found)} server(s)")
    for f in sorted(found, key=lambda f: f.address):
        print(f"server     {f.address}  {f.describe()}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tvm-deploy", description=__doc__.split("\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run every stage (make tune)")
    _add_common(p)
    _add_pool(p)
    untuned = p.add_mutually_exclusive_group()
    untuned.add_argument("--untuned", action="store_true",
                         help="build the tuned buckets from default schedules too and time them beside the tuned ones "
                              "(the before/after line; a later run in the same workdir reuses that build)")
    untuned.add_argument("--no-untuned", action="store_true",
                         help="no untuned comparison, not even from an earlier build in the workdir")
    p.add_argument("--alternatives", default="torch-eager",
                   help="timed on the same inputs beside the package in the summary: comma list of torch-eager, "
                        "torch-compile, onnxruntime, or none (an ONNX source: ONNX Runtime stands in for PyTorch)")
    p.set_defaults(func=cmd_run)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"run the {stage} stage alone")
        _add_common(p)
        if stage == "tune":
            _add_pool(p)
        if stage == "profile":
            p.add_argument("--bucket", help="bucket to profile, e.g. 1 or 1-seq128 (default: the first tuned bucket)")
            p.add_argument("--iters", type=int, default=20)
            p.add_argument("--trace", help="also write 3 runs as a Chrome trace / Perfetto timeline (JSON) here")
            p.add_argument("--debug-kernels", action="store_true",
                           help="first run once with a device synchronization after every kernel: a fault names its kernel")
        p.set_defaults(func=cmd_stage)
    p = sub.add_parser("bench", help="latency diff of the package against the other runtimes")
    _add_common(p)
    p.add_argument("--runners", default="tvm,tvm-untuned,onnxruntime,onnxruntime-fp16,torch-eager,torch-eager-fp16,torch-compile,tensorrt",
                   help="comma-separated; see deploy.bench.runners.ALL_RUNNERS")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="warm-up iterations before each runner's turn")
    p.add_argument("--rounds", type=int,
                   help="rounds the iterations are split into, the runners taking turns in each (all stay loaded); "
                        "default 5 (at most --iters); 1: one runner after another, each released before the next")
    p.add_argument("--compile-mode", default="max-autotune", help="torch.compile mode")
    p.add_argument("--baseline", action="append", help="baseline.json of a TensorRT run measured elsewhere (repeatable)")
    p.add_argument("--out", help="results folder (default <workdir>/bench)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("serve", help="serve a package over HTTP (Open Inference Protocol / KServe v2)")
    _add_package(p, config_mod.ServeConfig())
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("loadtest", help="throughput and p50/p99 of the server at several concurrencies vs the raw module")
    lt = config_mod.LoadtestConfig()
    _add_package(p, lt.serve)
    p.add_argument("--concurrency", help=f"comma-separated levels (default {','.join(map(str, lt.concurrency))})")
    p.add_argument("--duration-s", type=float, help=f"measured seconds per level (default {lt.duration_s:g})")
    p.add_argument("--warmup-s", type=float, help=f"unmeasured seconds before each level (default {lt.warmup_s:g})")
    p.add_argument("--request-batch", type=int, help=f"samples per request (default {lt.request_batch})")
    p.add_argument("--client-procs", type=int, help="client processes (default: one per 4 cores, at most 8)")
    p.add_argument("--raw-seconds", type=float, help=f"seconds timing each bucket without HTTP (default {lt.raw_seconds:g})")
    p.add_argument("--out", help="results folder (default results/<cpu or the GPU's name, e.g. h200>/<date>/<model>-loadtest)")
    p.set_defaults(func=cmd_loadtest)
    p = sub.add_parser("pack-databases", help="fold what killed tuning runs left into the .xz files; rebuild the kernel stores")
    p.add_argument("root", nargs="?", default="tuning_logs")
    p.set_defaults(func=cmd_pack_databases)
    p = sub.add_parser("rpc-tracker", help="start TVM's RPC tracker (foreground)")
    p.add_argument("--host", default=config_mod.RPC_HOST,
                   help=f"address to listen on (default {config_mod.RPC_HOST}; 0.0.0.0 for servers on other hosts)")
    p.add_argument("--port", type=int, default=config_mod.RPC_TRACKER_PORT, help=f"port (default {config_mod.RPC_TRACKER_PORT})")
    p.set_defaults(func=cmd_rpc_tracker)
    p = sub.add_parser("rpc-server", help="start TVM's RPC server for one GPU, registered with a tracker (foreground)")
    p.add_argument("--tracker", required=True, help="HOST:PORT of the tracker")
    p.add_argument("--key", required=True, help="the key to register under (the same for every GPU of one model)")
    p.add_argument("--gpu", help="the GPU this server measures on (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--host", default=config_mod.RPC_HOST,
                   help=f"address to listen on (default {config_mod.RPC_HOST}; 0.0.0.0 when the tracker is on another host)")
    p.add_argument("--port", type=int, default=config_mod.RPC_SERVER_PORT,
                   help=f"first port to try (default {config_mod.RPC_SERVER_PORT}); the next free one up to --port-end is taken")
    p.add_argument("--port-end", type=int, help="last port to try, exclusive (default --port + 100)")
    p.add_argument("--custom-addr", help="the address to register with the tracker, if not the one it sees")
    p.set_defaults(func=cmd_rpc_server)
    p = sub.add_parser("rpc-status", help="the RPC servers registered under a key, and their devices")
    p.add_argument("--tracker", required=True, help="HOST:PORT of the tracker")
    p.add_argument("--rpc-key", required=True)
    p.set_defaults(func=cmd_rpc_status)
    p = sub.add_parser("info", help="check a package and print its manifest summary")
    p.add_argument("package")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("doctor", help="check this machine for building and running packages (docs/diagnostics.md)")
    p.add_argument("--package", help="also check whether this package folder loads here, and why not")
    p.add_argument("--json", action="store_true", help="write the rows as JSON to stdout")
    p.set_defaults(func=cmd_doctor)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    t0 = time.time()
    command = "tvm-deploy " + shlex.join(argv)
    args.command_line = command
    try:
        rc = args.func(args)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        print(f"FAILED | {time.time() - t0:.1f}s | {command}", file=sys.stderr)
        if getattr(e, "device_lost", False):
            # The faulted CUDA context aborts the interpreter's teardown
            # ("terminate called ... CUDA Runtime Error"): leave without it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted (finished stages and measured tuning records are kept)", file=sys.stderr)
        return 130
    if rc:  # e.g. serve, when loading the package failed with a bug (its traceback is in the log above)
        print(f"error: {args.command} failed | got exit status {rc} | expected 0 (the log above says why)",
              file=sys.stderr)
        print(f"FAILED | {time.time() - t0:.1f}s | {command}", file=sys.stderr)
        return rc
    print(f"PASSED | {time.time() - t0:.1f}s | {command}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
