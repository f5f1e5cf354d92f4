"""The whole job: export -> frontend -> optimize -> tune -> build -> validate,
then the latency of the package before and after tuning.

Stages never import each other's internals; this module hands each stage its
predecessor's artifact. Stage folders live in one workspace:
  <workdir>/export  frontend  optimize  tune  untuned  package  summary.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import traceback
from pathlib import Path

from . import artifacts, build, export, frontend, optimize, validate
from .config import Config, Profile, RPCPool, parse_duration, to_dict
from .errors import BuildError, DeployError, error_line
from .shapes import all_buckets, parse
from .targets import TargetInfo
from .tuning import database as dbs
from .tuning import graph, tune

log = logging.getLogger(__name__)

DEFAULT_DB_ROOT = artifacts.REPO_ROOT / "tuning_logs"
DEFAULT_ARTIFACTS = Path("artifacts")


@dataclasses.dataclass(frozen=True)
class Workspace:
    root: Path

    def __getattr__(self, stage: str) -> Path:
        if stage.startswith("_"):
            raise AttributeError(stage)
        return self.root / stage


@contextlib.contextmanager
def stage_guard(workdir: Path, stage: str):
    """A failure inside TVM (or any non-user error) in `stage` becomes one
    BuildError line naming the stage and TVM's own last line; the whole trace
    goes to <workdir>/logs/<stage>.log. User errors pass through unchanged."""
    try:
        yield
    except DeployError as e:
        if e.__cause__ is None:
            raise
        path = _write_trace(workdir, stage, e.__cause__)
        raise type(e)(f"{e} | full trace in {path}") from None
    except Exception as e:  # noqa: BLE001 - reported in one line, the trace in the log
        path = _write_trace(workdir, stage, e)
        raise BuildError(f"{stage} failed: {error_line(e)} | full trace in {path}") from None


def _write_trace(workdir: Path, stage: str, exc: BaseException) -> Path:
    path = Path(workdir) / "logs" / f"{stage}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)))
    return path


def default_workdir(cfg: Config, target: TargetInfo) -> Path:
    profile = cfg.profile(target.kind)
    return DEFAULT_ARTIFACTS / cfg.model.name / f"{target.slug}-{profile.precision}"


def describe(cfg: Config, target: TargetInfo, workdir: Path, db_root: Path, budget: str, pool: RPCPool | None = None) -> str:
    profile = cfg.profile(target.kind)
    lines = [
        f"model      {cfg.model.name} (source {cfg.model.source}, seed {cfg.model.seed}"
        + (f", checkpoint {cfg.model.checkpoint}" if cfg.model.checkpoint else "") + ")",
        f"target     {target.kind} {target.arch} on {target.device_name or 'no device (cross-compile)'}",
        f"           {target.spec}",
        f"profile    {json.dumps(dataclasses.asdict(profile))}",
        f"budget     {budget or 'none'}",
        f"workdir    {workdir}",
        f"databases  {db_root}",
    ]
    from .tuning.pool import LazyLoopback

    if isinstance(pool, LazyLoopback):
        lines.append(f"measure on this machine's device from {pool.lanes} tuning lanes (a loopback pool, started "
                     "when a database has trials left)")
    elif pool is not None:
        lanes = f"{pool.lanes} tuning lane(s)" if pool.lanes else "one tuning lane per server"
        lines.append(f"measure on RPC servers under key '{pool.key}' at tracker {pool.address} ({lanes})")
    return "\n".join(lines)


def existing_databases(cfg: Config, profile: Profile, target: TargetInfo, inputs, db_root: Path,
                       dims: tuple = ()) -> tuple[dict, dict]:
    """(bucket -> database key, bucket -> database folder) for the buckets
    whose database has records: what the build applies. With none, while the
    model has databases of these buckets for another x86-64 level or
    another GPU (records that do not apply here), one line says so."""
    keys, dirs = db_keys(cfg, profile, target, inputs, db_root, dims)
    found = {b: d for b, d in dirs.items() if dbs.has_records(d)}
    if found:
        return keys, found
    wanted = sorted({d.name for d in dirs.values()})
    others = {p: [p / n for n in wanted if dbs.has_records(p / n)]
              for p in (Path(db_root) / cfg.model.name).glob(f"{target.kind}-*") if p.is_dir() and p.name != target.slug}
    others = {p: ds for p, ds in others.items() if ds}
    if others and target.kind == "llvm":
        log.warning("build: %s has CPU tuning databases for %s, not for this machine's %s (%s): its kernels are "
                    "untuned here; tune here, or build on a machine of that level", cfg.model.name,
                    ", ".join(sorted(p.name.removeprefix("llvm-") for p in others)), target.arch, target.device_name)
    elif others:
        gpus = sorted({_tuned_on(ds[0]) or p.name for p, ds in others.items()})
        here, advice = ((f"this GPU ({target.device_name})",
                         f"tune on this GPU (make tune MODEL={cfg.model.name} BUDGET=10m) to make its own")
                        if target.device_name else
                        ("a cross-compile (no GPU here)", "build on the GPU they were tuned on to apply them"))
        log.warning("build: %s has tuning databases of these buckets for %s, not for %s: records tuned on one GPU "
                    "are not applied on another, so its kernels get default schedules (or this GPU's kernel store's "
                    "records); %s", cfg.model.name, ", ".join(gpus), here, advice)
    return keys, found


def _tuned_on(folder: Path) -> str | None:
    """The GPU a database's key names."""
    try:
        device = json.loads((folder / dbs.KEY_FILE).read_text())["target"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(device) if device else None


def db_keys(cfg: Config, profile: Profile, target: TargetInfo, inputs, db_root: Path,
            dims: tuple = ()) -> tuple[dict, dict]:
    """(bucket -> database key, bucket -> database folder), per shapes.Bucket."""
    buckets = all_buckets(profile, dims)
    keys = {b: dbs.database_key(cfg.model.name, inputs, b, profile, target, dims) for b in buckets}
    dirs = {b: dbs.database_dir(db_root, keys[b], target) for b in buckets}
    return keys, dirs


def tuned_direct(cfg: Config, profile: Profile, target: TargetInfo, inputs, db_root: Path, dims: tuple = ()
                 ) -> frozenset:
    """The buckets whose databases were tuned on direct convolutions
    (tuning/graph.py): the optimize stage keeps theirs direct."""
    _, dirs = db_keys(cfg, profile, target, inputs, db_root, dims)
    return frozenset(b for b, d in dirs.items() if graph.tuned_direct(d, b.batch))


SUMMARY_BUCKET_KEYS = ("tuned_kernels", "kernels", "compile_seconds", "schedules", "fallbacks", "store")


def run(
    cfg: Config,
    target: TargetInfo,
    workdir: Path,
    db_root: Path = DEFAULT_DB_ROOT,
    budget: str | None = None,
    dump_ir: bool = False,
    compare_untuned: bool | None = None,
    pool: RPCPool | None = None,
    alternatives: tuple[str, ...] = (),
) -> dict:
    """Every stage in a row. `compare_untuned`: True builds (or reuses) a copy
    of the tuned buckets from default schedules and times it beside them;
    None (the default) times such a copy only where an earlier run in this
    workdir left one built from the same optimized modules; False never.
    `alternatives` (bench.latency.ALTERNATIVES: torch-eager, torch-compile,
    onnxruntime) are timed on the same inputs and set beside the package's
    latency in the summary."""
    profile = cfg.profile(target.kind)
    budget = profile.budget if budget is None else budget
    budget_s = parse_duration(budget)
    ws = Workspace(Path(workdir))
    timings = {}
    (ws.root / "summary.json").unlink(missing_ok=True)  # (an earlier run's: this run writes its own as it goes)

    def timed(name, fn, *a, **kw):
        t0 = time.time()
        with stage_guard(ws.root, name):
            out = fn(*a, **kw)
        timings[name] = round(time.time() - t0, 1)
        log.info("%s: done in %.1f s", name, timings[name])
        return out

    exported = timed("export", export.run, cfg, ws.export)
    front = timed("frontend", frontend.run, profile, exported, ws.frontend)
    direct = tuned_direct(cfg, profile, target, exported.inputs, db_root, exported.dims)
    opt = timed("optimize", optimize.run, profile, target, front, ws.optimize, dump_ir=dump_ir, tuned_direct=direct)
    tune_summary = None
    if profile.trials > 0 and profile.tune_buckets:
        if not target.has_device and pool is None:
            log.warning("tune: skipped, no %s device here to measure candidates on (existing databases are still used)", target.kind)
        else:
            tuned = timed(
                "tune", tune.run, profile, target, opt, cfg.model.name, exported.inputs, db_root, ws.tune, budget_s,
                cfg.model.seed, pool, exported.dims,
            )
            tune_summary = json.loads((tuned.folder / "summary.json").read_text())
    keys, existing = existing_databases(cfg, profile, target, exported.inputs, db_root, exported.dims)
    if tune_summary is None and target.kind == "cuda" and target.has_device and existing:
        # (no tuning this run: the databases' kernels are still checked here before the build applies them;
        # on the GPU, where a wrong tensor-core record was seen, and where the check takes seconds a kernel)
        timed("check", tune.check_databases, sorted(set(existing.values())), target, db_root)
    package = timed("build", build.run, profile, target, exported, opt, existing, keys, ws.package, cfg.model.name,
                    db_root)
    report = latency = None

    def save(finished: bool) -> dict:
        # (after each stage from the build on: a run stopped later, e.g. a device chunk at its
        # time limit while torch.compile compiles an alternative, keeps what it measured)
        summary = {
            "package": str(ws.package),
            "model": cfg.model.name,
            "target": target.key(),
            "profile": to_dict(profile),
            "buckets": {b: {k: v for k, v in m.items() if k in SUMMARY_BUCKET_KEYS}
                        for b, m in package.manifest["buckets"].items()},
            "validation": None if report is None else {"passed": report["passed"], "worst_rel_l2": report["worst_rel_l2"]},
            "latency": latency,
            "tuning": tune_summary,
            "stage_seconds": timings,
            "finished": finished,
        }
        artifacts.write_json_atomic(ws.root / "summary.json", summary)
        return summary

    save(False)
    tol = getattr(cfg.tolerance, profile.precision)
    if target.has_device:
        report = timed("validate", validate.run, cfg, tol, ws.package, exported, cfg.model.seed)
        save(False)
    else:
        log.warning("validate: skipped, no %s device here to run the package on", target.kind)

    if target.has_device:
        any_tuned = any(m["tuned_kernels"] for m in package.manifest["buckets"].values())
        latency = timed("latency", measure_before_after, cfg, profile, target, exported, opt, package, ws,
                        compare_untuned if any_tuned else False)
        if alternatives:
            from .bench import latency as bench_latency

            save(False)
            alt = timed("alternatives", bench_latency.alternatives, cfg, profile, target.kind, exported,
                        exported.buckets(profile), alternatives, ws.package)
            for b, row in alt.items():
                latency[b]["alternatives"] = row
    return save(True)


def measure_before_after(cfg, profile, target, exported, opt, package, ws: Workspace, compare_untuned: bool | None) -> dict:
    """Latency of each bucket of the package; for the tuned buckets also of the
    same module built from default schedules only (the 'before'), the two
    timed in turns (runtime.latency_in_turns): built when `compare_untuned`
    is True, reused from this workdir when an earlier build of the same
    optimized modules is there (True or None)."""
    from . import runtime

    pred = runtime.load(package.folder)
    # buckets with a record for some kernel: their own database's, or the kernel store's
    tuned_buckets = [b for b in pred.buckets if package.manifest["buckets"][b.label]["tuned_kernels"]]
    how = None
    if compare_untuned is not False and tuned_buckets:
        key = untuned_key(opt, target, profile, tuned_buckets)
        key_file = ws.root / UNTUNED_KEY
        if key_file.is_file() and json.loads(key_file.read_text()) == key \
                and (ws.untuned / artifacts.MANIFEST).is_file():
            how = "cached"
        elif compare_untuned:
            key_file.unlink(missing_ok=True)
            plain = dataclasses.replace(profile, buckets=tuple(sorted({b.batch for b in tuned_buckets})))
            keys, _ = db_keys(cfg, plain, target, exported.inputs, DEFAULT_DB_ROOT, exported.dims)
            build.run(plain, target, exported, opt, {}, keys, ws.untuned, cfg.model.name, only=set(tuned_buckets))
            artifacts.write_json_atomic(key_file, key)
            how = "built"
    upred = runtime.load(ws.untuned, warn_unvalidated=False) if how else None
    out = {}
    for b in pred.buckets:
        if upred is not None and b in tuned_buckets:
            tuned, untuned = runtime.latency_in_turns([pred.timer(b), upred.timer(b)])
            out[b.label] = {"tuned": tuned, "untuned": {**untuned, "build": how}}
        else:
            out[b.label] = {"tuned": pred.latency(b)}
            if b in tuned_buckets and compare_untuned is not False:
                out[b.label]["untuned"] = None  # not compared: no build of it here, none asked for
    return out


UNTUNED_KEY = "untuned-key.json"


def _own_spaces_note(own: dict) -> str:
    """', 8 with our short-reduction space, 4 with our mma.sync GEMM' ({task: rule})."""
    from .passes.schedule import MMA_GEMM, SHORT_REDUCTION

    names = {SHORT_REDUCTION: "short-reduction space", MMA_GEMM: "mma.sync GEMM"}
    counts = {rule: sum(1 for r in own.values() if r == rule) for rule in names}
    return "".join(f", {n} with our {names[rule]}" for rule, n in counts.items() if n)


def _versus(name: str, alt: dict, tvm_ms: float) -> str:
    """An alternative's line: its median and the package's speed-up over it,
    against the package's median in the rounds they took turns in where
    there is one (`package_ms`, said), else its latency."""
    if "error" in alt:
        return f"{name}: could not run here ({alt['error']})"
    ms = alt["median_ms"]
    against = ""
    if "package_ms" in alt:
        tvm_ms = alt["package_ms"]
        against = f" (the package {tvm_ms:.3f} ms in turns with it)"
    if ms >= tvm_ms:
        return f"{name} {ms:.3f} ms on the same inputs{against}: the package is {ms / tvm_ms:.2f}x faster"
    return f"{name} {ms:.3f} ms on the same inputs{against}: the package is {tvm_ms / ms:.2f}x slower"


def untuned_key(opt, target: TargetInfo, profile: Profile, buckets) -> dict:
    """What an untuned build depends on: the optimized modules (their
    sha256), the target, the build's own options and its chain of default
    schedules (a new or changed rule gives kernels other defaults)."""
    from .passes.schedule import default_chain
    from .passes.wgmma_gemm import ARCHS

    hopper = target.kind == "cuda" and target.arch in ARCHS
    return {
        "modules": {str(b): opt.manifest["files"][opt.manifest["buckets"][str(b)]] for b in buckets},
        "target": target.key(),
        "cuda_graph": bool(profile.cuda_graph),
        "default_chain": default_chain(target.kind),
        # (the GEMMs' kernels, where the pass can take them; absent: keys as before)
        **({"wgmma_gemm": True} if hopper and profile.uses_wgmma_gemm else {}),
        **({"wgmma_gather": True} if hopper and profile.uses_wgmma_gemm else {}),
        "input_ranges": True,  # (a copy built before packages recorded them is built again, not loaded with a warning)
    }


def format_summary(summary: dict) -> str:
    lines = [f"package    {summary['package']}"]
    for b, info in sorted(summary["buckets"].items(), key=lambda kv: parse(kv[0])):
        line = f"bucket {b:>4}  {info['tuned_kernels']}/{info['kernels']} kernels tuned"
        if (info.get("store") or {}).get("not_in_database"):
            line += f" ({info['store']['not_in_database']} by other models, from the kernel store)"
        if info.get("fallbacks"):
            line += f", {len(info['fallbacks'])} fell back (manifest.json 'fallbacks' says why)"
        if build.stale_database(info):
            line += ", its database tuned for other kernels (tune it again)"
        lat = (summary.get("latency") or {}).get(b)
        if lat:
            line += f"  {lat['tuned']['median_ms']:.3f} ms"
            if lat.get("untuned"):
                u = lat["untuned"]["median_ms"]
                cached = ", a cached build" if lat["untuned"].get("build") == "cached" else ""
                line += f"  (untuned {u:.3f} ms, {u / lat['tuned']['median_ms']:.2f}x{cached})"
            elif "untuned" in lat:
                line += "  (untuned: not compared; UNTUNED=1 builds it, later runs here reuse it)"
            for name, alt in (lat.get("alternatives") or {}).items():
                line += "\n" + " " * 11 + _versus(name, alt, lat["tuned"]["median_ms"])
        lines.append(line)
    t = summary.get("tuning")
    if t:
        for b, s in t.items():
            vf = s["valid_fraction"]
            lines.append(
                f"tuning b{b}  {s['trials_after']} trials in database ({s['new_trials']} new, "
                f"{'n/a' if vf is None else f'{vf:.0%}'} valid, {s['tasks_selected']}/{s['tasks_total']} tasks"
                + (f", {len(s['without_tensor_cores'])} without tensor cores" if s.get("without_tensor_cores") else "")
                + _own_spaces_note(s.get("own_spaces") or {})
                + (f", {len(s['unschedulable'])} left to default schedules (no design space)"
                   if s.get("unschedulable") else "") + ")"
                + ("  stopped at the deadline" if s["stopped_by_deadline"] else "")
                + (f"  no search: timing the default schedules took {s['budget_spent_timing_defaults_s']:.0f} s of the "
                   "budget (once per database)" if s.get("budget_spent_timing_defaults_s") else "")
                + (f"  {s['kernel_check']['checked']} kernel(s) checked, {s['kernel_check']['rejected']} "
                   "rejected (computed something else than their default schedule)"
                   + (f", {s['kernel_check']['default_faster']} slower than their default schedule (the build keeps "
                      "the default)" if s["kernel_check"].get("default_faster") else "")
                   if (s.get("kernel_check") or {}).get("checked") else "")
                + (f"  done: it holds TRIALS={s['trials_wanted']} (a larger TRIALS tunes on)"
                   if not s["new_trials"] and s.get("trials_wanted") and s["trials_after"] >= s["trials_wanted"] else "")
            )
            split = s.get("time_split_s")
            if split and split.get("Total"):
                build_s = split.get("SendToBuilder", 0.0)
                run_s = split.get("SendToRunner", 0.0) + split.get("JoinRunnerFutures", 0.0)
                lanes = s.get("lanes")
                lines.append(
                    f"           {split['Total']:.0f} s tuning"
                    + (f" (summed over {len(lanes)} lanes, {s['seconds']:.0f} s wall)" if lanes else "")
                    + f": build {build_s:.0f} s, run {run_s:.0f} s, "
                    f"search and cost model {split['Total'] - build_s - run_s:.0f} s"
                    + (f", {s['trials_per_minute']} trials/min" if s.get("trials_per_minute") else "")
                )
            b = s.get("build")
            if b:
                busy = "" if b.get("busy") is None else f", workers busy {b['busy']:.0%} of it"
                others = ", ".join(f"{b[k]} {k.replace('_', ' ')}" for k in ("failed", "timed_out") if b.get(k))
                lines.append(
                    f"           building: {b['candidates']} candidates built in {b['batches']} batch(es)"
                    + (f" ({others})" if others else "")
                    + f", {b['candidate_p50_s']:.1f} s each (p90 {b['candidate_p90_s']:.1f}, "
                    f"max {b['candidate_max_s']:.1f}), a batch {b['batch_p50_s']:.1f} s{busy}"
                )
            r = s.get("rpc")
            if r:
                per = ", ".join(f"{a} {v['measured']}" for a, v in sorted(r["servers"].items()))
                lines.append(
                    f"           measured on {len(r['servers'])} RPC server(s) under key '{r['key']}' ({per})"
                    + (f"; {r['lost_sessions']} lost session(s), re-measured elsewhere" if r["lost_sessions"] else "")
                )
    v = summary.get("validation")
    lines.append(
        "validation " + ("not run (no device)" if v is None else ("PASSED" if v["passed"] else "FAILED") + f" (worst rel_l2 {v['worst_rel_l2']:.1e})")
    )
    return "\n".join(lines)
