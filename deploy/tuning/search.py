"""The search of the tune stage: MetaSchedule's evolutionary search bounded by a
wall-clock deadline, design spaces generated once (retried with other seeds),
and the cost model warm-started from a database's records.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def _make_deadline_search(deadline: float | None, budget: int, population: int, generations: int, stop=(),
                          journal=None, seed_configs=None):
    """An EvolutionarySearch that stops at a wall-clock deadline, after
    `budget` new trials (what is left of this task's budget), or once one of
    the `stop` events is set (the RPC pool is gone, the run was interrupted).
    Each batch it hands out is offered to `journal` (a `journal.Journal`).
    It also holds back a new batch while the candidates built and not yet
    measured would take until the deadline (`journal.backlog_seconds`,
    `_measuring_fits`): with
    an RPC pool, MetaSchedule's first round queues a batch of every task
    before any is measured, and ResNet-50 b64's lane of 15 tasks went on
    measuring minutes past a 6-minute budget, until the chunk was killed
    (results/h200/2026-12-04/resnet50-b64-implicit-gemm/chunk/).

    Its first batch also holds the design spaces of our mma.sync GEMM
    (passes/mma_gemm.py) that the database has no valid record of: each is
    one fixed kernel, which the cost model, trained on other schedules,
    might never pick from the population. `seed_configs`, where the plan
    knows them (tune._plan), are the configurations to measure; else those
    the database has no valid record of."""
    from ..tvm_compat import derived_object, ms

    @derived_object
    class DeadlineSearch(ms.search_strategy.PySearchStrategy):
        def __init__(self):
            self.inner = ms.search_strategy.EvolutionarySearch(
                population_size=population, genetic_num_iters=generations
            )
            self.task = None
            self.context = None
            self.seeds = []
            self.searching = False  # whether the evolutionary search has spaces (other than ours)

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)
            self.context = context
            if journal is not None:
                self.task = journal.task(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            from ..passes import mma_gemm

            # (our fixed kernels are measured as seeds only: in the evolutionary search they would be most of
            # the initial population, without a decision to mutate, and measured again)
            rest = [s for s in design_spaces if not mma_gemm.is_ours(s.mod)]
            self.searching = bool(rest)
            if rest:
                self.inner.pre_tuning(min(max_trials, budget), num_trials_per_iter, rest, database, cost_model)
            self.seeds = _seeds(self.context, design_spaces, database, seed_configs) if budget > 0 else []

        def post_tuning(self):
            if self.searching:
                self.inner.post_tuning()

        def generate_measure_candidates(self):
            if deadline is not None and not _measuring_fits(deadline, journal, stop):
                return None
            if any(e.is_set() for e in stop):
                return None
            seeds, self.seeds = self.seeds, []
            candidates = None
            if self.searching:
                from ..passes import mma_gemm

                for _ in range(3):  # (its population also replays the database's best records, ours among them)
                    batch = self.inner.generate_measure_candidates()
                    if batch is None:
                        break
                    candidates = [c for c in batch if not mma_gemm.is_ours(c.sch.mod)] or None
                    if candidates is not None:
                        break
            # (the seeds go with the search's first batch, not as a batch of their own: the task scheduler's
            # first round gives each task one batch, and a chunk that ends in it left ResNet-50 b64's
            # implicit GEMMs with their 2 to 8 seeds alone)
            candidates = (seeds + (candidates or [])) or None
            if journal is not None and candidates is not None:
                journal.offer(self.task, candidates)
            return candidates

        def notify_runner_results(self, measure_candidates, results):
            if self.searching:
                self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return _make_deadline_search(deadline, budget, population, generations, stop, journal, seed_configs)

    return DeadlineSearch()


BACKLOG_POLL_S = 1.0  # how often a held-back batch looks at the backlog again


def _measuring_fits(deadline: float, journal, stop=()) -> bool:
    """Whether a new batch may be handed out: before the deadline, and once
    the candidates built and not yet measured (`journal.backlog_seconds`)
    would be measured before it; until then it waits (the task scheduler's
    one thread with it: no task hands out more while the measuring catches
    up), so that a task is not ended while time is left."""
    while True:
        left = deadline - time.time()
        if left <= 0 or any(e.is_set() for e in stop):
            return False
        backlog = journal.backlog_seconds() if journal is not None else None
        if backlog is None or backlog < left:
            return True
        if not getattr(journal, "backlog_noted", False):
            journal.backlog_noted = True
            log.info("tune: %.0f s of built candidates wait to be measured, %.0f s before the deadline: "
                     "new batches wait", backlog, left)
        time.sleep(min(BACKLOG_POLL_S, left))


def _seeds(context, design_spaces, database, configs=None) -> list:
    """Measure candidates of the design spaces of passes/mma_gemm.py whose
    configuration is in `configs` (where None: that `database` holds no
    valid record of), postprocessed as the search's own."""
    from ..passes import mma_gemm
    from ..tvm_compat import ms, s_tir

    ours = [s for s in design_spaces if mma_gemm.is_ours(s.mod)]
    if not ours or context is None:
        return []
    done = set()
    if configs is not None:
        done = set(mma_gemm.CONFIGS) - set(configs)
    elif database is not None and database.has_workload(context.mod):
        for rec in database.get_top_k(database.commit_workload(context.mod), 1 << 10):
            text = str(rec.trace)
            done |= {name for name in mma_gemm.CONFIGS if f'"{name}"' in text}
    postprocs = list(context.space_generator.postprocs or [])
    out = []
    for space in ours:
        if mma_gemm.config_of(space.mod) in done:
            continue
        try:
            sch = s_tir.Schedule(context.mod, debug_mask=0)  # (Schedule.copy raises on these: unordered_map::at)
            space.trace.apply_to_schedule(sch, remove_postproc=True)
            if all(p.apply(sch) for p in postprocs):
                out.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True)))
                continue
        except Exception as e:  # noqa: BLE001 - a postprocessor that raises rejects the kernel, as in the search
            log.debug("tune: an mma_gemm seed rejected (%s)", e)
        _record_failure(database, context, space)
    return out


def _record_failure(database, context, space) -> None:
    """A configuration the postprocessors reject (more shared memory than
    this GPU allows, say) recorded as failed, so that the plan does not
    offer it again on every run (tune._plan)."""
    from ..tvm_compat import ms

    if database is None:
        return
    try:
        database.commit_tuning_record(ms.database.TuningRecord(
            space.trace, database.commit_workload(context.mod), [1e10], context.target,  # (as MetaSchedule records a failure)
            ms.arg_info.ArgInfo.from_prim_func(context.mod["main"])))
    except Exception as e:  # noqa: BLE001 - then it is offered again next time: never worse than that
        log.debug("tune: a rejected mma_gemm configuration not recorded (%s)", e)


def _design_space(task_mod, target, seed: int, attempts: int = 8):
    """MetaSchedule's default design space (post-order-apply of the target's
    rules), generated once and reused. Generation samples tile sizes, and in
    TVM 0.27 some samples make `compute-at` raise a ScheduleError ("not a
    stage pipeline"; seen on ResNet-50's 3x3 256-channel NHWC fp16 conv), which
    would abort the whole tuning run from inside the task scheduler. So it is
    retried with other seeds.

    On CUDA a task that fails every time is then given the rules without
    tensor cores (`SIMT_FALLBACK`): TVM 0.27's tensor-core tiling raises
    "Back optional access" on a matrix-vector product with an epilogue (the
    fp16 1x1 convolutions + SiLU of EfficientNet's squeeze-excitation, one
    output row), which left 17 of its 73 kernels untuned. `cache["rules"]`
    says which rules the space came from; a task that fails both ways
    raises the first error and is left to the default schedules."""
    from ..tvm_compat import ms, register_tensor_intrinsics

    register_tensor_intrinsics()  # (a TuneContext imports them, slowly: tvm_compat says why)
    cache: dict = {}

    def generate(rules, attempt: int):
        ctx = ms.TuneContext(mod=task_mod, target=target, space_generator=rules, rand_state=seed + 7919 * attempt)
        return list(ctx.generate_design_space())

    def sch_fn(_sch):
        if "spaces" not in cache:
            own = _own_spaces(task_mod, target)
            error = None
            for attempt in range(attempts):
                try:
                    cache["spaces"] = generate("post-order-apply", attempt)
                    cache["attempts"], cache["rules"] = attempt + 1, "default"
                    break
                except Exception as e:  # ScheduleError / TVMError
                    error = e
            else:
                if target.kind.name == "cuda":
                    for extra in range(FALLBACK_ATTEMPTS):
                        try:
                            cache["spaces"] = generate(SIMT_FALLBACK, attempts + extra)
                            cache["attempts"], cache["rules"] = attempts + extra + 1, SIMT_FALLBACK
                            break
                        except Exception:  # noqa: BLE001, S112 - the tensor-core error is the one to report
                            continue
                if "spaces" not in cache:  # (our spaces, where there are any, are the task's only ones)
                    if not own:
                        raise error
                    cache["spaces"], cache["attempts"], cache["rules"] = [], attempts, OWN_RULES
                from .tasks import _first_line  # (tasks imports this module)

                cache["default_error"] = _first_line(str(error)) or type(error).__name__
            if own:
                from ..passes import mma_gemm
                from ..passes.schedule import MMA_GEMM, SHORT_REDUCTION

                cache["spaces"] = cache["spaces"] + own
                cache["own"] = len(own)
                cache["own_rule"] = MMA_GEMM if any(mma_gemm.is_ours(x.mod) for x in own) else SHORT_REDUCTION
        return cache["spaces"]

    from ..passes import mma_epilogue

    return ms.space_generator.ScheduleFn(sch_fn, postprocs=mma_epilogue.postprocs(target)), cache


def _own_spaces(task_mod, target) -> list:
    """Design spaces of our own rules, added to MetaSchedule's, on CUDA:
    `ShortReduction`'s (passes/gpu_default.py: depthwise convolutions, small
    pooling windows), its block size a decision: MetaSchedule's tiling of
    such a kernel at a large batch draws no candidate VerifyGPUCode
    accepts, so without it the task found nothing. And one space per
    configuration of our `mma.sync` GEMM (passes/mma_gemm.py), each
    measured first (`DeadlineSearch`)."""
    if target.kind.name != "cuda":
        return []
    from ..passes import mma_gemm
    from ..passes.gpu_default import ShortReduction

    out = []
    try:
        sch = ShortReduction().apply(task_mod["main"], target, True)
        if sch is not None:
            out.append(sch)
    except Exception as e:  # noqa: BLE001 - our rule failing on a kernel leaves MetaSchedule's spaces
        log.debug("tune: ShortReduction's design space not made (%s)", e)
    try:
        out += mma_gemm.spaces(task_mod["main"], target)
    except Exception as e:  # noqa: BLE001 - likewise
        log.debug("tune: mma_gemm's design spaces not made (%s)", e)
    return out


OWN_RULES = "own"  # cache["rules"] when only our spaces were made

# MetaSchedule's CUDA schedule rules without the tensor-core tiling (the kind
# "cuda"). The space is generated with them; the tuning context's
# postprocessors and mutators stay the target's, a superset that leaves
# schedules without tensor-core blocks as they are.
SIMT_FALLBACK = "cuda"
FALLBACK_ATTEMPTS = 3


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
    from ..passes import mma_epilogue
    from ..tvm_compat import ms

    batches = []
    for ctx in contexts:
        if not db.has_workload(ctx.mod):
            continue
        cands, results = [], []
        for rec in db.get_top_k(db.commit_workload(ctx.mod), per_task):
            try:
                cand = rec.as_measure_candidate()
                # (a replayed trace lacks our postprocessors' changes; the features lower the schedule)
                mma_epilogue.declare_accumulator_reads(cand.sch)
                cands.append(cand)
            except Exception:  # a trace that no longer replays: skip it  # noqa: S112
                continue
            results.append(ms.runner.RunnerResult([float(x) for x in rec.run_secs], None))
        if cands:
            batches.append((ctx, cands, results))
    if not batches:
        return 0
    held = model.last_train_size
    model.last_train_size = 1 << 60  # no training until the last update
    learnt = []
    try:
        for i, (ctx, cands, results) in enumerate(batches):
            if i == len(batches) - 1:
                model.last_train_size = 0
            try:
                model.update(ctx, cands, results)
                learnt.append((ctx, cands, results))
            except Exception as e:  # noqa: BLE001 - one task's records that do not featurize: the others still count
                from .tasks import _first_line  # (tasks imports this module)

                log.info("tune: cost model not warmed from %s's records (%s)", ctx.task_name,
                         _first_line(str(e)) or type(e).__name__)
        if model.last_train_size == 1 << 60 and learnt:  # the last task's failed: train on what was learnt,
            ctx, cands, results = learnt[-1]  # re-adding one record to trigger it
            model.last_train_size = 0
            model.update(ctx, cands[:1], results[:1])
    finally:
        if model.last_train_size == 1 << 60:
            model.last_train_size = held
    return sum(len(c) for _, c, _ in learnt)
