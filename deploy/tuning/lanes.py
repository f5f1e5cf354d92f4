"""Tuning lanes: a bucket's tasks split over several tuning processes (one per
RPC server, or several on one GPU), each with its share of the trials, its
own database folded back into the bucket's, and their stats combined.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .. import artifacts
from ..config import RPCPool
from ..errors import DeployError
from . import builder as candidates
from . import database as dbs
from . import journal as tuning_journal
from . import tasks as task_loop

log = logging.getLogger(__name__)


# The per-task lists of a lane's tune summary, merged over the lanes.
SUMMARY_TASK_LISTS = ("unschedulable", "without_tensor_cores", "own_spaces", "own_spaces_only")


def lanes(pool: RPCPool | None, n_servers: int) -> int:
    """Tuning processes for a run: one without a pool (a local GPU measures
    one candidate at a time); with a pool, `pool.lanes`, or one per server."""
    if pool is None:
        return 1
    return max(1, pool.lanes or n_servers)


def lane_cpus(pool: RPCPool | None, n_lanes: int) -> int:
    """CPUs each of `n_lanes` lanes uses: `pool.lane_cpus` (at most this
    machine's), or an equal share."""
    have = candidates.usable_cpus()
    if pool is not None and pool.lane_cpus:
        return min(pool.lane_cpus, have)
    return max(1, have // max(1, n_lanes))


def split_tasks(todo: list[dict], n: int) -> list[list[dict]]:
    """Tasks into `n` lanes of about equal trials left (longest first onto
    the lane with the fewest): a lane tunes its tasks start to end, so the
    run lasts as long as its busiest lane."""
    out: list[list[dict]] = [[] for _ in range(n)]
    load = [0] * n
    for p in sorted(todo, key=task_loop.order):
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
                summary, stats, store=None) -> None:
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
            "store": store,
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
        out = {"crash": f"{type(e).__name__}: {task_loop._first_line(str(e)) or type(e).__name__}"}
    artifacts.write_atomic(spec["result"], pickle.dumps(out))


def _combine_lanes(results: list[dict], summary: dict, stats: dict, cpus: int) -> None:
    split: dict = {}
    rpc_all = None
    times = candidates.empty_build_times(cpus)
    summary["lanes"] = []
    for r in results:
        stats.update(r["stats"])
        lane_times = r["summary"].get("build_times")
        if lane_times:
            for k in ("batch_wall_s", "candidate_s", "failed", "timed_out"):
                times[k] += lane_times[k]
        for k, v in r["summary"].get("time_split_s", {}).items():
            split[k] = round(split.get(k, 0.0) + v, 2)
        for k in SUMMARY_TASK_LISTS:
            summary.setdefault(k, {}).update(r["summary"].get(k, {}))
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
                                 "build": candidates.build_stats(lane_times) if lane_times else {},
                                 "cost_model_warm_start": r["summary"].get("cost_model_warm_start")})
    for k in SUMMARY_TASK_LISTS:
        if not summary.get(k):
            summary.pop(k, None)
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
    db = dbs.open_for_tuning(spec["db"], spec["key"], seed_from=spec["seed_from"], store=spec.get("store"))
    journal = tuning_journal.Journal(spec["db"])
    try:
        task_loop._tune_tasks(todo, spec["global_left"], db, spec["name"], spec["key"], spec["target"], spec["profile"],
                    spec["deadline"], Path(spec["work"]), spec["seed"], spec["pool"], spec["n_servers"],
                    spec["cpus"], summary, stats, lane=spec["lane"], journal=journal)
    except DeployError as e:  # the pool was lost: the parent raises it once every lane's records are folded in
        fatal = e
    finally:
        journal.close()
    for s in stats.values():
        s["best_s"] = None if s["best_s"] is None else float(s["best_s"])
    return {"lane": spec["lane"], "summary": summary, "stats": stats, "fatal": fatal,
            "seconds": round(time.time() - started, 1)}
