"""The task loop of the tune stage: MetaSchedule's task scheduler over one
bucket's tasks on this machine's device or an RPC pool, with every failed
candidate's reason recorded and a clean wind-down on the first Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import threading
import time
from pathlib import Path

from ..config import Profile, RPCPool
from ..passes.schedule import SHORT_REDUCTION
from ..targets import TargetInfo
from . import builder as candidates
from . import journal as tuning_journal
from . import search as deadline_search
from .rpc import LOST, ignore_sigint

log = logging.getLogger(__name__)


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


def _make_progress_callback(names: list[str], stats: dict, failures_path: Path, bar, count: bool = True):
    """Per-task counts, failure reasons and best times, as MetaSchedule
    hands each task's measured batch back; the bar's count too unless
    `count` is False (the journal then counts each candidate as it is
    measured: MetaSchedule hands a batch back only when its task scheduler
    returns to that task, which in the first round is after every other
    task has had a batch, minutes later)."""
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
            if count:
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


def _runner(target: TargetInfo, profile: Profile, pool: RPCPool | None = None, n_servers: int = 0, stop=None,
            journal=None):
    """This machine's device (MetaSchedule's LocalRunner), or the RPC pool,
    with the same evaluator settings: kernel times compare across the two.
    Each result goes to `journal` as it is measured."""
    from ..tvm_compat import ms

    if pool is not None:
        from . import rpc

        return rpc.make_runner(pool, target, n_servers, _evaluator_config(target), profile.runner_timeout_s, stop,
                               on_result=None if journal is None else journal.measured_future)
    local = ms.runner.LocalRunner(timeout_sec=profile.runner_timeout_s, evaluator_config=_evaluator_config(target),
                                  initializer=ignore_sigint)
    return local if journal is None else tuning_journal.make_runner(local, journal)


def task_flops(task) -> float:
    from ..tvm_compat import estimate_tir_flops

    try:
        return float(estimate_tir_flops(task.dispatched[0]))
    except Exception:  # estimation is best-effort (some ops are opaque)
        return 0.0


def extract_tasks(mod, target):
    """MetaSchedule's tasks of the module, less those already scheduled, the
    fused attention kernels (passes/attention.py: one schedule of ours, no
    decisions to tune) and pure reshapes: the build turns a reshape into a view of its input
    (RewriteDataflowReshape), so its kernel never runs (a reshape left alone
    after a reduction, say; flat_gemm's have gone at the optimize stage).
    (The GEMMs our wgmma kernel takes are left out by tune.py: `wgmma_tasks`.)"""
    from ..passes.attention import is_attention
    from ..tvm_compat import ms

    tasks = ms.relax_integration.extract_tasks(mod, target)
    return [t for t in tasks if (not t.mod.attrs or not t.mod.attrs.get("tirx.is_scheduled", False))
            and not _is_reshape(t.dispatched[0]["main"]) and not is_attention(t.dispatched[0]["main"])]


def wgmma_tasks(tasks, target, gather: bool = False) -> list[str]:
    """The names of the tasks whose kernel passes/wgmma_gemm.py plans on
    `target` (a TVM target; none but on sm_90; implicit GEMMs with `gather`): the build gives them that
    kernel before any tuning record, so tune.py does not tune them. Where
    the kernel is not made (a plan that raises, a template that does not
    parse) the task is kept: the build keeps that kernel's chain too
    (wgmma_gemm.replacement). (One that is made and then does not compile
    falls back untuned: the build's fallbacks name it.)"""
    from ..passes import wgmma_gemm

    if not wgmma_gemm.available(target):
        return []
    taken = []
    for t in tasks:
        try:
            if wgmma_gemm.replacement(t.dispatched[0]["main"], gather=gather) is not None:
                taken.append(t.task_name)
        except Exception:  # noqa: BLE001 - see the docstring
            pass
    return taken


def _is_reshape(func) -> bool:
    from ..tvm_compat import relax

    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except Exception:  # noqa: BLE001 - not analysable: tuned as any kernel
        return False


def order(p: dict) -> tuple:
    """Sort key of tune plans' entries, first to tune first: those with
    configurations of our mma.sync GEMM to measure (tune._plan); then most
    trials left; then, among kernels timed under their default schedules
    (`check.time_defaults`), the most time per run (weight x time); then the
    most FLOPs per run. MetaSchedule's task scheduler gives the tasks one
    round each in this order before it chooses by gradient, so a short chunk
    reaches only the first few (a 3-minute chunk, ~4 tasks per lane)."""
    timed = p.get("default_us")
    return (not p.get("mma_missing"), -p["left"], timed is None, -(timed or 0.0) * p["weight"],
            -p["flops"] * p["weight"])


def stored_module(db, mod):
    """The module to tune for task `mod`: the one `db` already holds for a
    structurally equal workload (names aside), else `mod`, which `db` then
    holds (a TVM 0.27 workaround).

    MetaSchedule files each measured record under the first structurally
    equal workload of the database, and structural equality ignores names,
    while a record's trace finds blocks by names made from the buffers' (a
    cache stage of `lv4` is `lv4_reindex_pad_shared.dyn`). A kernel whose
    buffers were renamed since it was tuned (an optimize change that shifted
    Relax's variable numbering; another model's kernel from the kernel
    store) was tuned under its new names, its records were filed under the
    old ones, and the database no longer loaded: "Cannot find a block with
    the name: lv4_reindex_pad_shared.dyn_wmma.matrix_b_o" (ViT-S/16 b32 on
    the H200, 2026-12-04). Tuning the stored module keeps trace and workload
    together; it is the same computation.
    tests/tuning/test_workload_names.py fails once MetaSchedule's records
    no longer depend on names."""
    return db.commit_workload(mod).mod


def _new_stats() -> dict:
    return {"candidates": 0, "build_errors": 0, "run_errors": 0, "best_s": None}


def _tune_tasks(todo, global_left, db, label_name, key, target, profile, deadline, work, seed, pool, n_servers, cpus,
                summary, stats, lane: int | None = None, journal=None) -> None:
    """MetaSchedule over `todo` into `db`, with `cpus` build workers and
    search threads; fills `stats` (per task) and `summary` (time split, RPC
    statistics, tasks without a design space). Every candidate is written to
    `journal` (a `journal.Journal` beside `db`) as it is measured. Raises the
    RPC pool's fatal error after the run has stopped."""
    from tqdm.auto import tqdm

    from ..tvm_compat import ms

    tvm_target = target.tvm_target()
    todo = [dict(p, mod=stored_module(db, p["mod"])) for p in todo]
    for p in todo:
        stats[p["name"]] = _new_stats()
    stop = threading.Event()  # set by the RPC runner when its pool is lost
    interrupted = threading.Event()  # set by the first Ctrl-C
    logs = work / "logs" / label_name
    _drop_unnamed_handlers()
    loggers = ms.logging.get_loggers_from_work_dir(str(logs), [p["name"] for p in todo])
    _quiet_console()
    seeds = ms.utils.fork_seed(seed, n=len(todo))
    spaces = [deadline_search._design_space(p["mod"], tvm_target, s) for p, s in zip(todo, seeds)]
    contexts = [
        ms.TuneContext(
            mod=p["mod"],
            target=tvm_target,
            space_generator=space,
            search_strategy=deadline_search._make_deadline_search(
                deadline, p["left"], profile.search_population, profile.search_generations, (stop, interrupted),
                journal, p.get("mma_missing"),
            ),
            task_name=p["name"],
            logger=lg,
            rand_state=s,
            # every core given: the evolutionary search is CPU-bound between batches
            num_threads=cpus,
        )
        for p, lg, s, (space, _) in zip(todo, loggers, seeds, spaces)
    ]
    # Generate (and cache) each design space before tuning: a task whose
    # space cannot be generated is left to the default schedules.
    kept = []
    for p, ctx, (_, cache) in zip(todo, contexts, spaces):
        try:
            ctx.generate_design_space()
            kept.append((p, ctx))
            if cache.get("rules") == deadline_search.SIMT_FALLBACK:
                summary.setdefault("without_tensor_cores", {})[p["name"]] = cache["default_error"]
                log.info("tune: %s: no tensor-core design space (%s); tuned with the rules without tensor cores",
                         p["name"], cache["default_error"])
            if cache.get("own"):
                summary.setdefault("own_spaces", {})[p["name"]] = cache.get("own_rule", SHORT_REDUCTION)
            if cache.get("rules") == deadline_search.OWN_RULES:
                summary.setdefault("own_spaces_only", {})[p["name"]] = cache["default_error"]
                log.info("tune: %s: no design space of MetaSchedule's rules (%s); tuned with ours alone",
                         p["name"], cache["default_error"])
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
        warm = deadline_search.warm_cost_model(cost_model, contexts, db)
    except Exception as e:  # a new, empty model then, as MetaSchedule's own
        log.warning("tune: cost model not warmed from the database (%s)", _first_line(str(e)))
        cost_model, warm = new_cost_model(), 0
    summary["cost_model_warm_start"] = {"records": warm, "seconds": round(time.time() - t0, 1)}
    # MetaSchedule's own profiler splits the time between search,
    # building, running and the cost model: where tuning time goes.
    builder = candidates._make_builder(cpus, profile.builder_timeout_s, journal=journal)
    runner = _runner(target, profile, pool, n_servers, stop, journal)
    measurer = getattr(runner, "measurer", None)  # the RPC pool's state
    try:
        with tqdm(total=global_left, desc=label, unit="trial", dynamic_ncols=True, position=lane or 0) as bar, \
                ms.Profiler() as prof, _wind_down_on_interrupt(interrupted, label):
            if journal is not None:  # (each candidate counted as it is measured, or as its build fails)
                journal.on_record = lambda: bar.update(1)
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
                    _make_progress_callback([p["name"] for p in todo], stats, failures, bar, count=journal is None),
                ],
                task_scheduler="gradient",
            )
    finally:
        if journal is not None:
            journal.on_record = None  # (the bar is closed)
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
