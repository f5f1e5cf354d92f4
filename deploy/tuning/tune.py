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
  - loses no measured candidate when killed outright (SIGKILL, the
    out-of-memory killer): MetaSchedule saves a batch only when it comes
    back to its task, so each candidate is also journaled as it is measured
    (`journal`) and folded into the database the next time it is opened.
A line cut short by a kill is dropped on the next open.

This module is the stage (plan, run, summary); the wing's other modules serve
it: `tasks` (the task loop), `builder` (the candidate builder), `search` (the
deadline search and design spaces), `lanes` (several tuning processes),
`database` and `rpc` (the pool of GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from .. import artifacts
from ..config import InputSpec, Profile, RPCPool
from ..errors import TargetError
from ..optimize import OptimizeArtifact
from ..shapes import parse, tuned_buckets
from ..targets import TargetInfo
from . import builder as candidates
from . import check as kernel_check
from . import database as dbs
from . import graph
from . import journal as tuning_journal
from . import lanes as tuning_lanes
from . import pool as rpc_pool
from . import store as kernel_store
from . import tasks as task_loop

log = logging.getLogger(__name__)
STAGE = "tune"


@dataclasses.dataclass(frozen=True)
class TuneArtifact:
    folder: Path
    databases: dict  # shapes.Bucket -> database folder
    manifest: dict


MIN_SEARCH_S = 30.0  # after timing the defaults, less of the budget than this left: no search started


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
    store_root: Path | None = None,
) -> dict:
    """Tune one bucket's module into the database at `db_dir`; returns a
    summary. The database's working copy is packed however the run ends
    (deadline, Ctrl-C, an error, the RPC pool lost). With `pool`, candidates
    are measured on its `n_servers` servers (checked by `rpc_devices.check_pool`),
    from `lanes(pool, n_servers)` tuning processes. The kernel store under
    `store_root` seeds each task that another model tuned."""
    tvm_target = target.tvm_target()
    all_tasks = task_loop.extract_tasks(mod, tvm_target)
    wgmma = task_loop.wgmma_tasks(all_tasks, tvm_target, gather=True) if profile.uses_wgmma_gemm else []
    if wgmma:  # (the build gives them our wgmma kernel before any record: tuning them would be time lost)
        log.info("tune: %s: %d GEMM kernel(s) take the wgmma kernel (passes/wgmma_gemm.py), not tuned: %s",
                 db_dir.name, len(wgmma), ", ".join(wgmma))
        taken = set(wgmma)
        all_tasks = [t for t in all_tasks if t.task_name not in taken]
    if dbs.has_records(db_dir):
        dbs.check_key(db_dir, key)
        dbs.pack(db_dir)  # what a killed run left (working copy, journal, lanes) counts towards the plan
    # (with MAX_TASKS, the times a previous run kept choose as it chose: a run that finds the tasks it tuned
    # done tunes nothing and reports those tasks, not the heaviest in FLOPs)
    task_mods = [{"name": t.task_name, "mod": t.dispatched[0]} for t in all_tasks]
    cached = kernel_check.cached_default_us(db_dir, task_mods, target.kind) if profile.max_tasks else None
    plan, global_left = _plan(all_tasks, db_dir, profile, cached, tvm_target)
    default_us = None  # {task: us}, once timed
    timed_s = 0.0
    if global_left > 0 and 0 < profile.max_tasks < len(all_tasks) and target.has_device \
            and (deadline is None or time.time() < deadline):
        # which tasks MAX_TASKS keeps: the slowest per run under their default schedules (timed once, kept
        # with the database), not the heaviest in FLOPs; only when there is tuning to do
        t0 = time.time()
        try:
            default_us = kernel_check.time_defaults(db_dir, task_mods, target)
            plan, global_left = _plan(all_tasks, db_dir, profile, default_us, tvm_target)
        except Exception as e:  # noqa: BLE001 - chosen by FLOPs instead; tuning goes on
            default_us = None
            log.warning("tune: %s: default schedules not timed (%s); MAX_TASKS keeps the heaviest in FLOPs",
                        db_dir.name, task_loop._first_line(str(e)) or type(e).__name__)
        timed_s = time.time() - t0
    summary = {
        "database": str(db_dir),
        "tasks_total": len(all_tasks),
        **({"tasks_wgmma": len(wgmma)} if wgmma else {}),
        "tasks_selected": len(plan),
        "tasks": {},
        "trials_before": sum(p["done"] for p in plan),
        "trials_wanted": profile.trials,  # what the database should hold (TRIALS)
        "cpus": candidates.usable_cpus(),
    }
    left = [p for p in plan if p["left"] > 0]
    if left and global_left > 0 and target.has_device and (deadline is None or time.time() < deadline):
        # where the check times kernels (a pool's devices match this one); only the ordering depends on it
        t0 = time.time()
        try:  # (every task's already, where MAX_TASKS chose by them)
            times = default_us if default_us is not None else kernel_check.time_defaults(db_dir, left, target)
        except Exception as e:  # noqa: BLE001 - the order falls back to FLOPs; tuning goes on
            log.warning("tune: %s: default schedules not timed (%s); tasks ordered by FLOPs", db_dir.name,
                        task_loop._first_line(str(e)) or type(e).__name__)
            times = {}
        for p in plan:
            p["default_us"] = times.get(p["name"])
        timed_s += time.time() - t0
    todo = sorted(left, key=task_loop.order)
    if todo and timed_s > 0 and deadline is not None and deadline - time.time() < MIN_SEARCH_S:
        # (the first run of a database times every kernel's default once: on the H200 EfficientNet-B0's
        # 70 kernels took 83 s of a 90-second budget, and two lanes then started for nothing)
        log.warning("tune: %s: the budget is spent: timing the default schedules (once per database) took %.0f s "
                    "of it; nothing tuned in this run (the next run tunes from the start of its budget)",
                    db_dir.name, timed_s)
        todo = []
        summary["budget_spent_timing_defaults_s"] = round(timed_s, 1)
    first = [p for p in todo[:3] if p.get("default_us") is not None]
    if first:
        log.info("tune: %s: %d kernels to tune take %.0f us per run under their default schedules (timed in %.0f s); "
                 "tuned first: %s", db_dir.name, len(todo), sum((p.get("default_us") or 0.0) * p["weight"] for p in todo),
                 timed_s, ", ".join(f"{p['name']} {p['default_us']:.0f} us x{p['weight']:.0f}" for p in first))
    stats: dict = {}
    started = time.time()
    work_left = todo and global_left > 0 and (deadline is None or time.time() < deadline)
    if isinstance(pool, rpc_pool.LazyLoopback):
        # a loopback pool starts only for work to do in two lanes or more (one lane measures here, as without)
        more = work_left and min(pool.lanes, len(todo)) > 1
        pool, n_servers = (pool.start(), 1) if more else (None, 0)
    n_lanes = min(tuning_lanes.lanes(pool, n_servers), len(todo))
    if work_left:
        seeds = None
        if store_root is not None:
            seeds = kernel_store.lines_for(store_root, target, kernel_store.workload_hashes([p["mod"] for p in todo]))
            summary["store_seeds"] = len(seeds[1])
        if n_lanes > 1:
            tuning_lanes._tune_lanes(todo, n_lanes, global_left, db_dir, key, target, profile, deadline, work, seed, pool, n_servers,
                        summary, stats, seeds)
        else:
            db = dbs.open_for_tuning(db_dir, key, store=seeds)
            journal = tuning_journal.Journal(db_dir)
            try:
                task_loop._tune_tasks(todo, global_left, db, db_dir.name, key, target, profile, deadline, work, seed, pool,
                            n_servers, tuning_lanes.lane_cpus(pool, 1), summary, stats, journal=journal)
            finally:
                journal.close()
                dbs.pack(db_dir)
    summary.update(_outcome(plan, db_dir, stats, time.time() - started, deadline))
    times = summary.pop("build_times", None)  # this run's, or its lanes' merged: the raw seconds
    if times is not None:
        summary["build"] = candidates.build_stats(times)
    summary["database_digest"] = dbs.digest(db_dir)
    return summary


def _plan(all_tasks, db_dir: Path, profile: Profile, default_us: dict | None = None,
          tvm_target=None) -> tuple[list[dict], int]:
    """The tasks to tune (with `max_tasks`, the slowest per run under their
    default schedules, `default_us` {task: us}, then the heaviest in FLOPs
    among those not timed), each with the trials it already has and what is
    left of its budget; and the trials left overall.

    A task our mma.sync GEMM takes (passes/mma_gemm.py) also lists the
    configurations its database has no record of, valid or not
    (`mma_missing`), and is given at least that many trials, also where the
    database holds its `trials` already (then no other task is given any;
    not with TRIALS=0): a database tuned before that schedule existed gets
    it measured once. Once `trials` is spent (less than a batch left),
    tasks the database has no record of get their share of it (their number
    over the tasks tuned): a changed graph's new kernels are tuned. A
    configuration the search's postprocessors reject is recorded as a
    failure (search._seeds), so it is not offered again."""
    flops = {t.task_name: task_loop.task_flops(t) for t in all_tasks}
    us = default_us or {}
    ranked = sorted(all_tasks, key=lambda t: (t.task_name not in us, -us.get(t.task_name, 0.0) * t.weight,
                                              -flops[t.task_name] * t.weight))
    chosen = ranked[: profile.max_tasks] if profile.max_tasks else ranked
    done_all = dict(zip((t.task_name for t in ranked), dbs.trials_done(db_dir, [t.dispatched[0] for t in ranked])))
    missing = _mma_missing(chosen, db_dir, tvm_target) if profile.trials > 0 else {}
    plan = []
    for t in chosen:
        done, best = done_all[t.task_name]
        left = max(0, profile.trials_per_task - done)
        todo = missing.get(t.task_name, [])
        plan.append({"name": t.task_name, "mod": t.dispatched[0], "weight": float(t.weight), "flops": flops[t.task_name],
                     "done": done, "best_s": best, "left": max(left, len(todo)), "mma_missing": todo})
    # (over every task: trials spent on tasks another MAX_TASKS choice kept count towards TRIALS too)
    total_done = sum(done for done, _ in done_all.values())
    room = max(0, profile.trials - total_done)
    # Kernels the database has no record of (the graph changed, or an option such as --implicit-gemm made
    # other kernels) get their share of TRIALS, as many parts of it as they are of the tasks tuned, once
    # the others' records have spent TRIALS (less than a batch left): they alone are tuned then (with our
    # configurations). While TRIALS is not spent, tasks share what is left as before, however many
    # records each has (a chunk cut by its deadline resumes so).
    new = [p for p in plan if p["done"] == 0 and p["left"] > 0]
    share = min(profile.trials * len(new) // len(plan), sum(p["left"] for p in new)) if new else 0
    if room < profile.trials_per_iter and room < share:
        log.info("tune: %d kernel(s) without records get %d trials, their share of TRIALS=%d (the database's "
                 "%d trials are of the other kernels)", len(new), share, profile.trials, total_done)
        for p in plan:
            if p["done"]:
                p["left"] = len(p["mma_missing"])
        room = share
    if room == 0:  # TRIALS reached: only our configurations are measured (tasks.order puts them first)
        for p in plan:
            p["left"] = len(p["mma_missing"])
    extra = sum(len(p["mma_missing"]) for p in plan)
    global_left = min(room + extra, sum(p["left"] for p in plan))
    return plan, global_left


def _mma_missing(tasks, db_dir: Path, tvm_target) -> dict[str, list[str]]:
    """{task: configurations of our mma.sync GEMM that apply and that its
    database has no record of}, on CUDA targets with cp.async."""
    from ..passes import mma_gemm

    if tvm_target is None or not mma_gemm.available(tvm_target):
        return {}
    applies = {}
    for t in tasks:
        planned = mma_gemm.plan(t.dispatched[0]["main"])
        configs = mma_gemm.configs_for(planned[0]) if planned is not None else []
        if configs:
            applies[t.task_name] = (t.dispatched[0], configs)
    if not applies:
        return {}
    have = dbs.marked(db_dir, [m for m, _ in applies.values()], list(mma_gemm.CONFIGS)) if dbs.has_records(db_dir) \
        else [set()] * len(applies)
    out = {}
    for (name, (mod, configs)), got in zip(applies.items(), have):
        missing = [c for c in configs if c not in got]
        if missing:  # (only those that schedule here: one that raises is never a candidate, never recorded)
            made = {mma_gemm.config_of(s.mod) for s in mma_gemm.spaces(mod["main"], tvm_target)}
            missing = [c for c in missing if c in made]
        if missing:
            out[name] = missing
    return out


def _outcome(plan: list[dict], db_dir: Path, stats: dict, elapsed: float, deadline: float | None) -> dict:
    """Per-task trials and best times from the database (all records, not
    only this run's), this run's candidate counts, and the totals."""
    tasks = {}
    for p, (done, best) in zip(plan, dbs.trials_done(db_dir, [p["mod"] for p in plan])):
        s = stats.get(p["name"], task_loop._new_stats())
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


# ------------------------------------------------------------------ lanes ---


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
    dims: tuple = (),
) -> TuneArtifact:
    """Tune every tuned bucket (`dims`: the model's dimensions besides the
    batch; every length of each is tuned for the tuned batch sizes). Candidates are measured on this machine's
    device, or with `pool` on the RPC servers under its key, whose devices
    must all match `target` (checked first)."""
    n_servers = 0
    if pool is not None and not isinstance(pool, rpc_pool.LazyLoopback):  # (a loopback pool: this device)
        from . import devices as rpc_devices

        n_servers = len(rpc_devices.check_pool(pool, target))
    elif not target.has_device:
        raise TargetError(
            f"cannot tune for {target.kind} {target.arch} here: candidates are measured on the device", "no device",
            "the machine with that GPU, or a pool of them through an RPC tracker (--tracker, --rpc-key)",
        )
    deadline = None if budget_s is None else time.time() + budget_s
    with artifacts.staged_dir(folder) as tmp:
        summaries, folders = {}, {}
        order = tuned_buckets(profile, dims)
        for k, bucket in enumerate(order):
            key = dbs.database_key(model, inputs, bucket, profile, target, dims)
            db_dir = dbs.database_dir(db_root, key, target)
            # The budget is shared: each bucket gets an equal part of what is
            # left (one that is done sooner leaves its time to the next).
            share = None if deadline is None else time.time() + max(0.0, deadline - time.time()) / (len(order) - k)
            implicit = opt.manifest.get("implicit_gemms", {}).get(bucket.label)
            if implicit is not None:  # (a new database: the graph it is tuned on, which later builds then make)
                graph.record(db_dir, implicit)
            summaries[bucket.label] = tune_bucket(
                opt.load_module(bucket), db_dir, key, target, profile, share, tmp, seed, pool, n_servers, db_root
            )
            if target.has_device and dbs.has_records(db_dir):  # each kernel checked where it runs (check.py)
                summaries[bucket.label]["kernel_check"] = check_one(db_dir, target)
            folders[bucket.label] = str(db_dir)
        # The store follows new records, and records the check has just left out (rejected, or slower than
        # their default schedule), which other models' builds would otherwise still apply.
        if any(s.get("new_trials") for s in summaries.values()) or \
                _check_left_out([s.get("kernel_check") or {} for s in summaries.values()]):
            refresh_store(db_root, target)
        # Logs are bulky; keep them out of the manifest's hashed files.
        files = [f for f in ("failures.jsonl",) if (tmp / f).is_file()]
        artifacts.write_json_atomic(tmp / "summary.json", summaries)
        files.append("summary.json")
        artifacts.write_manifest(
            tmp,
            STAGE,
            {"databases": folders, "target": target.key(), "profile": dataclasses.asdict(profile), "budget_s": budget_s,
             "rpc": _pool_info(pool, n_servers)},
            files=files,
        )
    return load(folder)


def _pool_info(pool, n_servers: int) -> dict | None:
    if isinstance(pool, rpc_pool.LazyLoopback):
        pool, n_servers = pool.started, 1
    return None if pool is None else {"tracker": pool.address, "key": pool.key, "servers": n_servers}


def load(folder: Path) -> TuneArtifact:
    m = artifacts.read_manifest(folder, STAGE)
    return TuneArtifact(Path(folder), {parse(b): Path(p) for b, p in m["databases"].items()}, m)


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


def check_databases(dirs, target: TargetInfo, db_root: Path) -> dict[str, dict]:
    """The kernel check (check.py) of databases used without tuning (a build
    from done databases, `TRIALS=0`), so a package built where the device is
    applies only checked kernels, as one built after tuning does; records
    checked before are not checked again. {database folder: counts}. Best
    effort: a failure of the check itself is one warning (the build then
    applies the databases as they are)."""
    out = {}
    try:
        for d in dirs:
            out[str(d)] = check_one(Path(d), target)
    except Exception as e:  # noqa: BLE001
        log.warning("check: tuned kernels not checked (%s); the build applies the databases as they are",
                    task_loop._first_line(str(e)) or type(e).__name__)
    if _check_left_out(out.values()):
        refresh_store(db_root, target)
    return out


def check_one(db_dir: Path, target: TargetInfo) -> dict:
    counts = kernel_check.check_database(db_dir, target)
    log.info("tune: %s: %d tuned kernel(s) checked against default schedules, %d rejected, "
             "%d slower than the default", db_dir.name, counts["checked"], counts["rejected"],
             counts["default_faster"])
    return counts


def _check_left_out(counts) -> bool:
    return any(c.get("rejected") or c.get("default_faster") for c in counts)


def refresh_store(db_root: Path, target: TargetInfo) -> None:
    try:
        for dest, n in kernel_store.refresh(db_root, only=target.key()).items():
            log.info("tune: kernel store %s: %d kernels", dest, n)
    except (OSError, ValueError) as e:  # the databases are saved; the store is rebuilt by the next run
        log.warning("tune: kernel store not refreshed (%s); `python -m deploy pack-databases` rebuilds it", e)
