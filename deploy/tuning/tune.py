"""Stage 4, tune: MetaSchedule with the XGBoost cost model, per tuned bucket.

Databases live under `tuning_logs/<model>/<target>/<variant>/`, keyed (in
`key.json`) by model, input shapes, precision, layout and target/GPU; they are
committed, because tuning is the expensive part. A run:
  - refuses a database whose key differs from what is being tuned;
  - counts the records each task already has and tunes only what is left of
    its budget, so a second run resumes and skips finished tasks;
  - stops cleanly at a wall-clock deadline: each task ends at its next
    candidate batch after the deadline, in-flight measurements are kept;
  - records every failed candidate's reason (build or run), which
    MetaSchedule's own logs only count;
  - measures on this machine's device, or on a pool of RPC servers through
    TVM's tracker (`deploy/tuning/rpc.py`; same database, one server per GPU).
  - stops cleanly on the first Ctrl-C (SIGINT, which `timeout --signal=INT`
    sends too): no new candidates, and what is built or being measured is
    measured and saved; a second Ctrl-C stops at once.
MetaSchedule saves a batch's results when it comes back to that task, which
in its first round is after every other task has had a batch (minutes, for
ResNet-50 at batch 64): a run killed outright loses the batches measured but
not yet saved. JSONDatabase appends one line per saved candidate; a line cut
short by a kill is dropped on the next open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

from .. import artifacts
from ..config import InputSpec, Profile, RPCPool
from ..errors import DeployError, TargetError
from ..optimize import OptimizeArtifact
from ..targets import TargetInfo
from . import database as dbs
from .rpc import LOST, ignore_sigint

log = logging.getLogger(__name__)
STAGE = "tune"


@dataclasses.dataclass(frozen=True)
class TuneArtifact:
    folder: Path
    databases: dict[int, Path]  # bucket -> database folder
    manifest: dict


# ------------------------------------------------------------ MetaSchedule ---


def lean_build(mod, target, _params):
    """MetaSchedule's default build minus its `import tvm.s_tir.tensor_intrin`,
    which parses ~500 TVMScript functions (40-75 s) in every fresh worker pool
    and ran past the builder's time-out. Candidates arrive already tensorized,
    so the workers do not need the intrinsics registered. It builds through
    the same TIR pipeline as the final compile (deploy.passes.tensor_core_smem)."""
    from deploy.passes import tensor_core_smem
    from deploy.tvm_compat import RemoveWeightLayoutRewriteBlock, tvm

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target, pipeline=tensor_core_smem.register())


def usable_cpus() -> int:
    """CPUs this process may use: its affinity set, capped by a cgroup CPU
    quota. os.cpu_count() (and MetaSchedule's default worker count) can see
    every core of the host inside a container."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def so_export(mod) -> str:
    """Export a built candidate as a shared library, linked here in the
    parallel build workers. MetaSchedule's default exports a .tar, which the
    runner then links (g++) before loading: serial work on the runner's side
    for every candidate, while the GPU waits."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="tvm-deploy-cand-"), "candidate.so")
    mod.export_library(path)
    return path


def _timed_build(job) -> tuple[str, float]:
    """MetaSchedule's build worker, in a build process: the artifact's path
    and the seconds this candidate took to build and export."""
    from ..tvm_compat import ms_builder_worker

    t0 = time.perf_counter()
    path = ms_builder_worker(*job)
    return path, time.perf_counter() - t0


def empty_build_times(workers: int) -> dict:
    """An empty record of build times: per build call (a batch) and per
    candidate built; the candidates that did not build."""
    return {"batch_wall_s": [], "candidate_s": [], "failed": 0, "timed_out": 0, "workers": workers}


def build_stats(times: dict) -> dict:
    """Where a run's build time went, from a builder's `times` (or several
    lanes' merged): per candidate (in the workers) and per batch (what
    tuning waited for). `busy` is the workers' share of the batches' wall
    time spent building: low means a batch waited on a few slow candidates
    (or on starting workers), not on building in general. `candidate_s`
    holds the candidates that built; `failed` and `timed_out` count the
    others (a time-out held its worker for the builder's limit)."""
    import numpy as np

    walls, workers = times["batch_wall_s"], times["workers"]
    if not walls:
        return {}
    each = np.asarray(times["candidate_s"] or [0.0])
    wall = float(sum(walls))
    return {
        "batches": len(walls), "candidates": len(times["candidate_s"]), "failed": times["failed"],
        "timed_out": times["timed_out"], "workers": workers,
        "wall_s": round(wall, 1), "batch_p50_s": round(float(np.median(walls)), 2),
        "candidate_p50_s": round(float(np.median(each)), 2), "candidate_p90_s": round(float(np.percentile(each, 90)), 2),
        "candidate_max_s": round(float(each.max()), 2), "candidate_sum_s": round(float(each.sum()), 1),
        "busy": round(float(each.sum()) / (wall * workers), 3) if wall > 0 else None,
    }


# NVRTC options for the build workers: with the headers every TVM CUDA
# kernel includes pre-included, NVRTC's automatic precompiled header (-pch)
# holds them, so a worker parses them once instead of for every candidate
# (TVM's preamble puts code right after its first #include, which ends what
# -pch alone would precompile). On the CPU machine: 0.26-0.39 of the NVRTC time
# per ResNet-50 candidate (p50 1.31 -> 0.51 s fp16 b1, 2.33 -> 1.10 s b64,
# 1.65 -> 0.54 s fp32), the same SASS bytes in 48 of 48 candidates
# (results/cpu/2026-11-30/nvrtc-compile, scripts/nvrtc_profile.py).
NVRTC_PCH_OPTS = ("-pch -include cuda/std/cstdint -include cuda/std/limits -include cuda/std/type_traits "
                  "-include cuda_fp16.h")
NVRTC_PCH_MIN = (12, 8)  # older NVRTC may reject -pch: then every candidate would fail


def _build_worker_init() -> None:
    """In each build worker: SIGINT ignored (see `rpc.ignore_sigint`), and
    NVRTC_PCH_OPTS, with an NVRTC that takes it, unless the user set
    TVM_CUDA_NVRTC_EXTRA_OPTS (empty turns it off)."""
    ignore_sigint()
    if "TVM_CUDA_NVRTC_EXTRA_OPTS" in os.environ:
        return
    try:
        from cuda.bindings import nvrtc

        _, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001  no NVRTC (a CPU target, or nvcc): nothing to set
        return
    if (major, minor) >= NVRTC_PCH_MIN:
        os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = NVRTC_PCH_OPTS


def sweep_nvrtc_pch(folder: str | None = None) -> int:
    """Remove NVRTC's precompiled-header folders (`__nvrtc_auto_pch_<pid>_*`
    in the temp folder, ~60 MB each) of processes that are gone: NVRTC
    removes its own only on a normal exit, and the build pool ends recycled
    and timed-out workers with SIGKILL. How many were removed."""
    import shutil
    import tempfile

    n = 0
    for d in Path(folder or tempfile.gettempdir()).glob("__nvrtc_auto_pch_*"):
        m = re.match(r"__nvrtc_auto_pch_(\d+)_", d.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:  # someone else's process
            continue
        if d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
        else:
            d.unlink(missing_ok=True)
        n += 1
    return n


def _make_builder(max_workers: int, timeout_s: float, recycle_after: int = 64):
    """MetaSchedule's LocalBuilder, but with one worker pool for the whole
    run. LocalBuilder starts a fresh pool for every batch, and each worker
    then imports TVM (which imports torch): seconds of every batch on 16
    workers. TVM restarts its pools because workers leak memory after many
    builds, so each worker here is replaced after `recycle_after` builds."""
    from ..tvm_compat import PopenPoolExecutor, StatusKind, derived_object, ms

    @derived_object
    class PersistentBuilder(ms.builder.PyBuilder):
        def __init__(self):
            super().__init__()
            self.pool = None
            self.times = empty_build_times(max_workers)

        def build(self, build_inputs):
            t0 = time.perf_counter()
            if self.pool is None:
                self.pool = PopenPoolExecutor(
                    max_workers=max_workers, timeout=timeout_s, maximum_process_uses=recycle_after,
                    initializer=_build_worker_init,
                )
            jobs = [(lean_build, so_export, b.mod, b.target, None) for b in build_inputs]
            results = []
            for r in self.pool.map_with_error_catching(_timed_build, jobs):
                if r.status == StatusKind.COMPLETE:
                    path, seconds = r.value
                    self.times["candidate_s"].append(seconds)
                    results.append(ms.builder.BuilderResult(path, None))
                elif r.status == StatusKind.TIMEOUT:
                    self.times["timed_out"] += 1
                    results.append(ms.builder.BuilderResult(None, f"build timed out after {timeout_s:.0f} s"))
                else:
                    self.times["failed"] += 1
                    results.append(ms.builder.BuilderResult(None, "build failed\n" + str(r.value)))
            self.times["batch_wall_s"].append(time.perf_counter() - t0)
            sweep_nvrtc_pch()
            return results

        def close(self):
            if self.pool is not None:
                self.pool.shutdown()
                self.pool = None
            sweep_nvrtc_pch()

    return PersistentBuilder()


def _first_line(msg: str) -> str:
    lines = [ln.strip() for ln in str(msg).strip().splitlines() if ln.strip()]
    # TVM errors end with the useful line ("Check failed: ..."); tracebacks start with noise.
    for ln in reversed(lines):
        if "Error" in ln or "failed" in ln.lower() or "Timeout" in ln:
            return ln[:300]
    return (lines[-1] if lines else "")[:300]


def _failure_reason(msg: str) -> str:
    """One line saying why a candidate failed. A compiler's log (NVRTC or
    nvcc: `file(line): error: ...`) ends with its error count or "Error limit
    reached.", and the first error is the one that says why; otherwise TVM's
    own check line."""
    for ln in str(msg).splitlines():
        m = re.search(r"\(\d+\): (?:catastrophic )?error(?: #\d+(?:-D)?)?: (.*)", ln)
        if m:
            return ("CUDA compile: " + m.group(1).strip())[:300]
    return _first_line(msg)


def _make_deadline_search(deadline: float | None, budget: int, population: int, generations: int, stop=()):
    """An EvolutionarySearch that stops at a wall-clock deadline, after
    `budget` new trials (what is left of this task's budget), or once one of
    the `stop` events is set (the RPC pool is gone, the run was interrupted)."""
    from ..tvm_compat import derived_object, ms

    @derived_object
    class DeadlineSearch(ms.search_strategy.PySearchStrategy):
        def __init__(self):
            self.inner = ms.search_strategy.EvolutionarySearch(
                population_size=population, genetic_num_iters=generations
            )

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            self.inner.pre_tuning(min(max_trials, budget), num_trials_per_iter, design_spaces, database, cost_model)

        def post_tuning(self):
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            if deadline is not None and time.time() >= deadline:
                return None
            if any(e.is_set() for e in stop):
                return None
            return self.inner.generate_measure_candidates()

        def notify_runner_results(self, measure_candidates, results):
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return _make_deadline_search(deadline, budget, population, generations, stop)

    return DeadlineSearch()


def _design_space(task_mod, target, seed: int, attempts: int = 8):
    """MetaSchedule's default design space (post-order-apply of the target's
    rules), generated once and reused. Generation samples tile sizes, and in
    TVM 0.27 some samples make `compute-at` raise a ScheduleError ("not a
    stage pipeline"; seen on ResNet-50's 3x3 256-channel NHWC fp16 conv), which
    would abort the whole tuning run from inside the task scheduler. So it is
    retried with other seeds, and a task that fails every time is left out."""
    from ..tvm_compat import ms

    cache: dict = {}

    def sch_fn(_sch):
        if "spaces" not in cache:
            error = None
            for attempt in range(attempts):
                ctx = ms.TuneContext(
                    mod=task_mod, target=target, space_generator="post-order-apply", rand_state=seed + 7919 * attempt
                )
                try:
                    cache["spaces"] = list(ctx.generate_design_space())
                    cache["attempts"] = attempt + 1
                    break
                except Exception as e:  # ScheduleError / TVMError
                    error = e
            else:
                raise error
        return cache["spaces"]

    return ms.space_generator.ScheduleFn(sch_fn), cache


def _make_progress_callback(names: list[str], stats: dict, failures_path: Path, bar):
    from ..tvm_compat import derived_object, ms

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            name = names[task_id]
            s = stats[name]
            with open(failures_path, "a") as f:
                for b, r in zip(builder_results, runner_results):
                    if r.error_msg and str(r.error_msg).startswith(LOST):
                        continue  # the RPC pool was lost: not run, not recorded (the run then fails)
                    s["candidates"] += 1
                    if b.error_msg:
                        s["build_errors"] += 1
                        f.write(json.dumps({"task": name, "stage": "build", "error": _failure_reason(b.error_msg)}) + "\n")
                    elif r.error_msg:
                        s["run_errors"] += 1
                        f.write(json.dumps({"task": name, "stage": "run", "error": _failure_reason(r.error_msg)}) + "\n")
                    elif r.run_secs:
                        secs = [float(x) for x in r.run_secs]
                        t = sum(secs) / len(secs)
                        if s["best_s"] is None or t < s["best_s"]:
                            s["best_s"] = t
            bar.update(len(runner_results))
            best = s["best_s"]
            bar.set_postfix_str(f"{name[:32]} best {best * 1e6:.1f} us" if best else f"{name[:32]} no valid yet")

    return Progress()


def _quiet_console() -> None:
    """MetaSchedule's logging config prints every task table to the console;
    keep those in its log files and show our progress bar instead. Its
    dictConfig may also disable loggers created before it: re-enable ours."""
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if not isinstance(lg, logging.Logger):
            continue
        if name.startswith("tvm.s_tir.meta_schedule"):
            for h in lg.handlers:
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                    h.setLevel(logging.WARNING)
        elif name.startswith("deploy"):
            lg.disabled = False


def _evaluator_config(target: TargetInfo):
    from ..tvm_compat import ms

    if target.kind == "cuda":
        return ms.runner.EvaluatorConfig(number=10, repeat=1, min_repeat_ms=20, enable_cpu_cache_flush=False)
    return ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=40, enable_cpu_cache_flush=False)


def _drop_unnamed_handlers() -> None:
    """MetaSchedule's logging config names the handlers its logger already
    has, and fails on one without a name ('NoneType' has no 'format'). pytest
    attaches its unnamed capture handler to every non-propagating logger, which
    MetaSchedule's is after one run: a second run in a later test failed."""
    lg = logging.getLogger("tvm.s_tir.meta_schedule")
    for h in list(lg.handlers):
        if h.get_name() is None:
            lg.removeHandler(h)


def _runner(target: TargetInfo, profile: Profile, pool: RPCPool | None = None, n_servers: int = 0, stop=None):
    """This machine's device (MetaSchedule's LocalRunner), or the RPC pool,
    with the same evaluator settings: kernel times compare across the two."""
    from ..tvm_compat import ms

    if pool is not None:
        from . import rpc

        return rpc.make_runner(pool, target, n_servers, _evaluator_config(target), profile.runner_timeout_s, stop)
    return ms.runner.LocalRunner(timeout_sec=profile.runner_timeout_s, evaluator_config=_evaluator_config(target),
                                 initializer=ignore_sigint)


def task_flops(task) -> float:
    from ..tvm_compat import estimate_tir_flops

    try:
        return float(estimate_tir_flops(task.dispatched[0]))
    except Exception:  # estimation is best-effort (some ops are opaque)
        return 0.0


def extract_tasks(mod, target):
    from ..tvm_compat import ms

    tasks = ms.relax_integration.extract_tasks(mod, target)
    return [t for t in tasks if not t.mod.attrs or not t.mod.attrs.get("tirx.is_scheduled", False)]


def tune_bucket(
    mod,
    db_dir: Path,
    key: dict,
    target: TargetInfo,
    profile: Profile,
    deadline: float | None,
    work: Path,
    seed: int = 0,
    pool: RPCPool | None = None,
    n_servers: int = 0,
) -> dict:
    """Tune one bucket's module into the database at `db_dir`; returns a
    summary. The database's working copy is packed however the run ends
    (deadline, Ctrl-C, an error, the RPC pool lost). With `pool`, candidates
    are measured on its `n_servers` servers (checked by `rpc.check_pool`),
    from `lanes(pool, n_servers)` tuning processes."""
    tvm_target = target.tvm_target()
    all_tasks = extract_tasks(mod, tvm_target)
    plan, global_left = _plan(all_tasks, db_dir, profile)
    summary = {
        "database": str(db_dir),
        "tasks_total": len(all_tasks),
        "tasks_selected": len(plan),
        "tasks": {},
        "trials_before": sum(p["done"] for p in plan),
        "trials_wanted": profile.trials,  # what the database should hold (TRIALS)
        "cpus": usable_cpus(),
    }
    todo = [p for p in plan if p["left"] > 0]
    n_lanes = min(lanes(pool, n_servers), len(todo))
    stats: dict = {}
    started = time.time()
    if todo and global_left > 0 and (deadline is None or time.time() < deadline):
        if n_lanes > 1:
            _tune_lanes(todo, n_lanes, global_left, db_dir, key, target, profile, deadline, work, seed, pool, n_servers,
                        summary, stats)
        else:
            db = dbs.open_for_tuning(db_dir, key)
            try:
                _tune_tasks(todo, global_left, db, db_dir.name, key, target, profile, deadline, work, seed, pool,
                            n_servers, lane_cpus(pool, 1), summary, stats)
            finally:
                dbs.pack(db_dir)
    summary.update(_outcome(plan, db_dir, stats, time.time() - started, deadline))
    times = summary.pop("build_times", None)  # this run's, or its lanes' merged: the raw seconds
    if times is not None:
        summary["build"] = build_stats(times)
    summary["database_digest"] = dbs.digest(db_dir)
    return summary


def _plan(all_tasks, db_dir: Path, profile: Profile) -> tuple[list[dict], int]:
    """The tasks to tune (the heaviest `max_tasks`), each with the trials it
    already has and what is left of its budget; and the trials left overall."""
    flops = {t.task_name: task_flops(t) for t in all_tasks}
    ranked = sorted(all_tasks, key=lambda t: flops[t.task_name] * t.weight, reverse=True)
    chosen = ranked[: profile.max_tasks] if profile.max_tasks else ranked
    plan = []
    for t, (done, best) in zip(chosen, dbs.trials_done(db_dir, [t.dispatched[0] for t in chosen])):
        plan.append({"name": t.task_name, "mod": t.dispatched[0], "weight": float(t.weight), "flops": flops[t.task_name],
                     "done": done, "best_s": best, "left": max(0, profile.trials_per_task - done)})
    total_done = sum(p["done"] for p in plan)
    global_left = min(max(0, profile.trials - total_done), sum(p["left"] for p in plan))
    return plan, global_left


def _outcome(plan: list[dict], db_dir: Path, stats: dict, elapsed: float, deadline: float | None) -> dict:
    """Per-task trials and best times from the database (all records, not
    only this run's), this run's candidate counts, and the totals."""
    tasks = {}
    for p, (done, best) in zip(plan, dbs.trials_done(db_dir, [p["mod"] for p in plan])):
        s = stats.get(p["name"], _new_stats())
        tasks[p["name"]] = {
            "weight": int(p["weight"]),
            "flops": p["flops"],
            "trials": done,
            "new_trials": s["candidates"],
            "build_errors": s["build_errors"],
            "run_errors": s["run_errors"],
            "best_us_before_run": None if p["best_s"] is None else p["best_s"] * 1e6,
            "best_us": None if best is None else best * 1e6,
        }
    new = sum(t["new_trials"] for t in tasks.values())
    bad = sum(t["build_errors"] + t["run_errors"] for t in tasks.values())
    return {
        "tasks": tasks,
        "trials_after": sum(t["trials"] for t in tasks.values()),
        "new_trials": new,
        "valid_fraction": None if not new else (new - bad) / new,
        "seconds": round(elapsed, 1),
        "trials_per_minute": None if not new or elapsed <= 0 else round(new / elapsed * 60, 1),
        "stopped_by_deadline": bool(deadline is not None and time.time() >= deadline and any(p["left"] for p in plan)),
    }


def _new_stats() -> dict:
    return {"candidates": 0, "build_errors": 0, "run_errors": 0, "best_s": None}


def _tune_tasks(todo, global_left, db, label_name, key, target, profile, deadline, work, seed, pool, n_servers, cpus,
                summary, stats, lane: int | None = None) -> None:
    """MetaSchedule over `todo` into `db`, with `cpus` build workers and
    search threads; fills `stats` (per task) and `summary` (time split, RPC
    statistics, tasks without a design space). Raises the RPC pool's fatal
    error after the run has stopped."""
    from tqdm.auto import tqdm

    from ..tvm_compat import ms

    tvm_target = target.tvm_target()
    for p in todo:
        stats[p["name"]] = _new_stats()
    stop = threading.Event()  # set by the RPC runner when its pool is lost
    interrupted = threading.Event()  # set by the first Ctrl-C
    logs = work / "logs" / label_name
    _drop_unnamed_handlers()
    loggers = ms.logging.get_loggers_from_work_dir(str(logs), [p["name"] for p in todo])
    _quiet_console()
    seeds = ms.utils.fork_seed(seed, n=len(todo))
    contexts = [
        ms.TuneContext(
            mod=p["mod"],
            target=tvm_target,
            space_generator=_design_space(p["mod"], tvm_target, s)[0],
            search_strategy=_make_deadline_search(
                deadline, p["left"], profile.search_population, profile.search_generations, (stop, interrupted),
            ),
            task_name=p["name"],
            logger=lg,
            rand_state=s,
            # every core given: the evolutionary search is CPU-bound between batches
            num_threads=cpus,
        )
        for p, lg, s in zip(todo, loggers, seeds)
    ]
    # Generate (and cache) each design space before tuning: a task whose
    # space cannot be generated is left to the default schedules.
    kept = []
    for p, ctx in zip(todo, contexts):
        try:
            ctx.generate_design_space()
            kept.append((p, ctx))
        except Exception as e:  # TVM raises ScheduleError/TVMError subclasses
            reason = _first_line(str(e))
            summary.setdefault("unschedulable", {})[p["name"]] = reason
            log.warning("tune: %s: no design space (%s); left to default schedules", p["name"], reason)
    todo, contexts = [p for p, _ in kept], [c for _, c in kept]
    global_left = min(global_left, sum(p["left"] for p in todo))
    failures = work / "failures.jsonl"
    where = "" if lane is None else f" (lane {lane})"
    log.info("tune: %s%s: %d tasks to tune, %d trials", label_name, where, len(todo), global_left)
    if not todo or global_left <= 0:
        return
    label = f"tune b{key['inputs'][0]['shape'][0]}" + ("" if lane is None else f" lane {lane}")
    def new_cost_model():
        return ms.cost_model.CostModel.create("xgb", num_tuning_cores=cpus, tree_method="auto")

    cost_model = new_cost_model()
    t0 = time.time()
    try:
        warm = warm_cost_model(cost_model, contexts, db)
    except Exception as e:  # a new, empty model then, as MetaSchedule's own
        log.warning("tune: cost model not warmed from the database (%s)", _first_line(str(e)))
        cost_model, warm = new_cost_model(), 0
    summary["cost_model_warm_start"] = {"records": warm, "seconds": round(time.time() - t0, 1)}
    # MetaSchedule's own profiler splits the time between search,
    # building, running and the cost model: where tuning time goes.
    builder = _make_builder(cpus, profile.builder_timeout_s)
    runner = _runner(target, profile, pool, n_servers, stop)
    measurer = getattr(runner, "measurer", None)  # the RPC pool's state
    try:
        with tqdm(total=global_left, desc=label, unit="trial", dynamic_ncols=True, position=lane or 0) as bar, \
                ms.Profiler() as prof, _wind_down_on_interrupt(interrupted, label):
            ms.tune_tasks(
                tasks=contexts,
                task_weights=[p["weight"] for p in todo],
                work_dir=str(logs),
                max_trials_global=global_left,
                max_trials_per_task=profile.trials_per_task,
                num_trials_per_iter=profile.trials_per_iter,
                builder=builder,
                runner=runner,
                database=db,
                cost_model=cost_model,
                measure_callbacks=[
                    ms.measure_callback.AddToDatabase() if measurer is None else measurer.add_to_database(),
                    ms.measure_callback.RemoveBuildArtifact(),
                    ms.measure_callback.UpdateCostModel(),
                    _make_progress_callback([p["name"] for p in todo], stats, failures, bar),
                ],
                task_scheduler="gradient",
            )
    finally:
        builder.close()
        if measurer is not None:
            measurer.close()
    if interrupted.is_set():  # every measured candidate is saved: now stop as Ctrl-C does
        raise KeyboardInterrupt
    summary["time_split_s"] = {k: round(float(v), 2) for k, v in sorted(prof.get().items(), key=lambda kv: -kv[1])}
    summary["build_times"] = builder.times  # tune_bucket turns it into summary["build"]
    if measurer is not None:
        summary["rpc"] = measurer.stats
        if measurer.fatal is not None:
            log.error("tune: %s", measurer.fatal)
            raise measurer.fatal


@contextlib.contextmanager
def _wind_down_on_interrupt(event: threading.Event, label: str):
    """While tuning, the first SIGINT sets `event` (the searches then give no
    new candidates, and MetaSchedule saves what it built or is measuring);
    a second one stops at once (raises KeyboardInterrupt). Python runs
    signal handlers in the main thread only: elsewhere this changes nothing.
    Workers (builds, measuring) ignore SIGINT (`rpc.ignore_sigint`). A
    KeyboardInterrupt raised in a MetaSchedule callback comes out of TVM as
    another error: after an interrupt, any error is that one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()
        log.warning("tune: %s: interrupted: no new candidates; those built are measured and saved "
                    "(interrupt again to stop at once)", label)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    except Exception as e:
        if event.is_set():
            raise KeyboardInterrupt from e
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


# Records per task the cost model is warmed with: replaying and featurizing
# the 1,593 records of ResNet-50's fp16 database (64 per task) took 70 s on
# the 2-core machine; 32 per task halves that.
WARM_RECORDS = 32


def warm_cost_model(model, contexts, db, per_task: int = WARM_RECORDS) -> int:
    """Train the XGBoost cost model on what the database already knows (the
    best `per_task` valid records of each task) before the first batch, as
    Ansor's `update_from_file` does on resume. MetaSchedule starts every run
    with an empty model, so a resumed run (each GPU chunk) searched its first
    batches blind. Returns the number of records it learnt from. Trained
    once, on the last update: XGBModel retrains on each update that grows its
    data by a fifth, which would be ~15 trainings here."""
    from ..tvm_compat import ms

    batches = []
    for ctx in contexts:
        if not db.has_workload(ctx.mod):
            continue
        cands, results = [], []
        for rec in db.get_top_k(db.commit_workload(ctx.mod), per_task):
            try:
                cands.append(rec.as_measure_candidate())
            except Exception:  # a trace that no longer replays: skip it  # noqa: S112
                continue
            results.append(ms.runner.RunnerResult([float(x) for x in rec.run_secs], None))
        if cands:
            batches.append((ctx, cands, results))
    if not batches:
        return 0
    held = model.last_train_size
    model.last_train_size = 1 << 60  # no training until the last update
    try:
        for i, (ctx, cands, results) in enumerate(batches):
            if i == len(batches) - 1:
                model.last_train_size = 0
            model.update(ctx, cands, results)
    finally:
        if model.last_train_size == 1 << 60:
            model.last_train_size = held
    return sum(len(c) for _, c, _ in batches)


# ------------------------------------------------------------------ lanes ---


def lanes(pool: RPCPool | None, n_servers: int) -> int:
    """Tuning processes for a run: one without a pool (a local GPU measures
    one candidate at a time); with a pool, `pool.lanes`, or one per server."""
    if pool is None:
        return 1
    return max(1, pool.lanes or n_servers)


def lane_cpus(pool: RPCPool | None, n_lanes: int) -> int:
    """CPUs each of `n_lanes` lanes uses: `pool.lane_cpus` (at most this
    machine's), or an equal share."""
    have = usable_cpus()
    if pool is not None and pool.lane_cpus:
        return min(pool.lane_cpus, have)
    return max(1, have // max(1, n_lanes))


def split_tasks(todo: list[dict], n: int) -> list[list[dict]]:
    """Tasks into `n` lanes of about equal trials left (longest first onto
    the lane with the fewest): a lane tunes its tasks start to end, so the
    run lasts as long as its busiest lane."""
    out: list[list[dict]] = [[] for _ in range(n)]
    load = [0] * n
    for p in sorted(todo, key=lambda p: (-p["left"], -p["flops"] * p["weight"])):
        i = min(range(n), key=lambda j: (load[j], len(out[j])))
        out[i].append(p)
        load[i] += p["left"]
    return [lane for lane in out if lane]


def lane_budgets(lefts: list[int], global_left: int, per_iter: int) -> list[int]:
    """Each lane's share of `global_left` trials, in whole batches of
    `per_iter`. MetaSchedule checks its trial budget before each batch,
    never inside one, so a lane given 96 trials in batches of 64 runs 128:
    batches go one at a time to the lane with the most trials left, until
    the budget is spent or no lane has any left. Like one process, the run
    may end up to a batch (per lane) past the budget."""
    out = [0] * len(lefts)
    while sum(out) < global_left:
        i = max(range(len(lefts)), key=lambda j: (lefts[j] - out[j], -j))
        if lefts[i] - out[i] <= 0:
            break
        out[i] += min(per_iter, lefts[i] - out[i])
    return out


def _tune_lanes(todo, n_lanes, global_left, db_dir, key, target, profile, deadline, work, seed, pool, n_servers,
                summary, stats) -> None:
    """Tune `todo` in `n_lanes` processes, each over its share of the tasks
    with its share of the CPUs, each measuring on the pool (the tracker
    hands each session a free server, so one GPU never measures two
    candidates at once). Each lane tunes into a working copy of its own
    (`dbs.lane_dir`), seeded from this database; `dbs.pack` folds every
    lane's records into `db_dir` however the lanes end. One process's tuning is CPU-bound (search and building are
    ~85% of a batch on the H200), so more GPUs alone would only shorten the
    measuring; lanes put every core and every GPU to work at once."""
    import multiprocessing
    import pickle

    from ..tvm_compat import save_json

    dbs.check_key(db_dir, key)
    dbs.pack(db_dir)  # records a killed run left (working copy, lanes): every lane seeds from them
    groups = split_tasks(todo, n_lanes)
    budgets = lane_budgets([sum(p["left"] for p in g) for g in groups], global_left, profile.trials_per_iter)
    groups, budgets = [g for g, b in zip(groups, budgets) if b], [b for b in budgets if b]
    cpus = lane_cpus(pool, len(groups))
    specs = []
    for i, (group, budget) in enumerate(zip(groups, budgets)):
        lane_work = work / "lanes" / f"lane-{i}"
        lane_work.mkdir(parents=True, exist_ok=True)
        specs.append({
            "lane": i,
            "tasks": [{k: v for k, v in p.items() if k != "mod"} | {"mod": save_json(p["mod"])} for p in group],
            "global_left": budget,
            "db": str(dbs.lane_dir(db_dir, i)), "seed_from": str(db_dir), "name": db_dir.name, "key": key, "target": target, "profile": profile,
            "deadline": deadline, "work": str(lane_work), "seed": seed + 104729 * i,
            "pool": pool, "n_servers": n_servers, "cpus": cpus, "result": str(lane_work / "result.pickle"),
        })
    log.info("tune: %s: %d tasks in %d lanes of %d CPUs each (%s tasks)", db_dir.name, len(todo), len(groups), cpus,
             "/".join(str(len(g)) for g in groups))
    # One process per lane (not a process pool, which stops every worker
    # when one dies): a lane that crashes leaves the others running.
    ctx = multiprocessing.get_context("spawn")  # never fork a process that has loaded TVM and CUDA
    procs = [ctx.Process(target=_lane_entry, args=(spec,), name=f"tune-lane-{spec['lane']}") for spec in specs]
    results, crashed = [], []
    try:
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
    finally:
        # Interrupted (Ctrl-C reaches the lanes too): give them time to stop
        # and pack, then fold in whatever every lane measured.
        for pr in procs:
            if pr.pid is not None:
                pr.join(timeout=LANE_STOP_S)
            if pr.is_alive():
                pr.terminate()
                pr.join(timeout=10)
        dbs.pack(db_dir)
        for spec in specs:
            failures = Path(spec["work"]) / "failures.jsonl"
            if failures.is_file():
                with open(work / "failures.jsonl", "a") as f:
                    f.write(failures.read_text())
    for spec, pr in zip(specs, procs):
        try:
            r = pickle.loads(Path(spec["result"]).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            r = {"crash": f"its process ended with exit code {pr.exitcode} and no result"}
        if "crash" in r:
            crashed.append((spec["lane"], r["crash"]))
        else:
            results.append(r)
    _combine_lanes(results, summary, stats, cpus)
    if crashed:
        lane, why = crashed[0]
        raise RuntimeError(f"tuning lane {lane} failed ({why}); every record measured is kept")
    fatal = next((r["fatal"] for r in results if r.get("fatal") is not None), None)
    if fatal is not None:
        log.error("tune: %s", fatal)
        raise fatal


# Seconds an interrupted lane has to stop and pack its database.
LANE_STOP_S = 60.0


def _lane_entry(spec: dict) -> None:
    """A lane's process: runs `_lane_main` and leaves its result (or why it
    failed) in `spec["result"]` for the parent."""
    import pickle
    import traceback

    try:
        out = _lane_main(spec)
    except BaseException as e:  # a bug, or Ctrl-C: the parent reports it
        traceback.print_exc()
        out = {"crash": f"{type(e).__name__}: {_first_line(str(e)) or type(e).__name__}"}
    path = Path(spec["result"])
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(out))
    os.replace(tmp, path)


def _combine_lanes(results: list[dict], summary: dict, stats: dict, cpus: int) -> None:
    split: dict = {}
    rpc_all = None
    times = empty_build_times(cpus)
    summary["lanes"] = []
    for r in results:
        stats.update(r["stats"])
        lane_times = r["summary"].get("build_times")
        if lane_times:
            for k in ("batch_wall_s", "candidate_s", "failed", "timed_out"):
                times[k] += lane_times[k]
        for k, v in r["summary"].get("time_split_s", {}).items():
            split[k] = round(split.get(k, 0.0) + v, 2)
        summary.setdefault("unschedulable", {}).update(r["summary"].get("unschedulable", {}))
        rpc = r["summary"].get("rpc")
        if rpc:
            if rpc_all is None:
                rpc_all = {"tracker": rpc["tracker"], "key": rpc["key"], "servers": {}, "retried": 0,
                           "lost_sessions": 0, "hung": [], "sessions": 0}
            for addr, c in rpc["servers"].items():
                have = rpc_all["servers"].setdefault(addr, {"measured": 0, "failed": 0, "lost": 0})
                for k in have:
                    have[k] += c.get(k, 0)
            rpc_all["retried"] += rpc["retried"]
            rpc_all["lost_sessions"] += rpc["lost_sessions"]
            rpc_all["sessions"] += rpc.get("sessions", 0)
            rpc_all["hung"] = sorted(set(rpc_all["hung"]) | set(rpc["hung"]))
        summary["lanes"].append({"lane": r["lane"], "tasks": sorted(r["stats"]), "cpus": cpus, "seconds": r["seconds"],
                                 "new_trials": sum(s["candidates"] for s in r["stats"].values()),
                                 "time_split_s": r["summary"].get("time_split_s", {}),
                                 "build": build_stats(lane_times) if lane_times else {},
                                 "cost_model_warm_start": r["summary"].get("cost_model_warm_start")})
    if not summary.get("unschedulable"):
        summary.pop("unschedulable", None)
    if split:
        # Summed over the lanes, which ran at the same time: CPU-side seconds, not wall time.
        summary["time_split_s"] = dict(sorted(split.items(), key=lambda kv: -kv[1]))
    if times["batch_wall_s"]:
        summary["build_times"] = times  # batch walls summed over the lanes, like time_split_s
    if rpc_all is not None:
        summary["rpc"] = rpc_all


def _lane_main(spec: dict) -> dict:
    """One lane, in a process of its own: its tasks into its database."""
    from ..tvm_compat import load_json

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    todo = [{**t, "mod": load_json(t["mod"])} for t in spec["tasks"]]
    summary: dict = {}
    stats: dict = {}
    fatal = None
    started = time.time()
    # Its records stay in the working copy, appended as measured: the run's
    # `dbs.pack` folds them in (or the next run's, if this one is killed).
    db = dbs.open_for_tuning(spec["db"], spec["key"], seed_from=spec["seed_from"])
    try:
        _tune_tasks(todo, spec["global_left"], db, spec["name"], spec["key"], spec["target"], spec["profile"],
                    spec["deadline"], Path(spec["work"]), spec["seed"], spec["pool"], spec["n_servers"],
                    spec["cpus"], summary, stats, lane=spec["lane"])
    except DeployError as e:  # the pool was lost: the parent raises it once every lane's records are folded in
        fatal = e
    for s in stats.values():
        s["best_s"] = None if s["best_s"] is None else float(s["best_s"])
    return {"lane": spec["lane"], "summary": summary, "stats": stats, "fatal": fatal,
            "seconds": round(time.time() - started, 1)}


def run(
    profile: Profile,
    target: TargetInfo,
    opt: OptimizeArtifact,
    model: str,
    inputs: tuple[InputSpec, ...],
    db_root: Path,
    folder: Path,
    budget_s: float | None,
    seed: int = 0,
    pool: RPCPool | None = None,
) -> TuneArtifact:
    """Tune every tuned bucket. Candidates are measured on this machine's
    device, or with `pool` on the RPC servers under its key, whose devices
    must all match `target` (checked first)."""
    n_servers = 0
    if pool is not None:
        from . import rpc

        n_servers = len(rpc.check_pool(pool, target))
    elif not target.has_device:
        raise TargetError(
            f"cannot tune for {target.kind} {target.arch} here: candidates are measured on the device", "no device",
            "the machine with that GPU, or a pool of them through an RPC tracker (--tracker, --rpc-key)",
        )
    deadline = None if budget_s is None else time.time() + budget_s
    with artifacts.staged_dir(folder) as tmp:
        summaries, folders = {}, {}
        for bucket in profile.tune_buckets:
            key = dbs.database_key(model, inputs, bucket, profile, target)
            db_dir = dbs.database_dir(db_root, key, target)
            summaries[str(bucket)] = tune_bucket(
                opt.load_module(bucket), db_dir, key, target, profile, deadline, tmp, seed, pool, n_servers
            )
            folders[str(bucket)] = str(db_dir)
        # Logs are bulky; keep them out of the manifest's hashed files.
        files = [f for f in ("failures.jsonl",) if (tmp / f).is_file()]
        artifacts.write_json_atomic(tmp / "summary.json", summaries)
        files.append("summary.json")
        artifacts.write_manifest(
            tmp,
            STAGE,
            {"databases": folders, "target": target.key(), "profile": dataclasses.asdict(profile), "budget_s": budget_s,
             "rpc": None if pool is None else {"tracker": pool.address, "key": pool.key, "servers": n_servers}},
            files=files,
        )
    return load(folder)


def load(folder: Path) -> TuneArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    return TuneArtifact(Path(folder), {int(b): Path(p) for b, p in m["databases"].items()}, m)


def failure_reasons(folder: Path, top: int = 5) -> list[tuple[str, int]]:
    """Most common failure reasons recorded in a tune artifact."""
    import collections

    path = Path(folder) / "failures.jsonl"
    if not path.is_file():
        return []
    c = collections.Counter()
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        c[f"{d['stage']}: {d['error']}"] += 1
    return c.most_common(top)
