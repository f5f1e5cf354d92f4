"""Tuned kernels checked against default schedules before a build trusts them.

MetaSchedule measures how fast a candidate runs, never what it computes. A
schedule that TVM lowers to wrong code is then simply the fastest record,
and every build applies it. Seen on the H200: one tensor-core schedule of
BERT's QKV projection at sequence length 64 (workload 7049442462938456694)
took the whole model from rel_l2 4e-4 to 2.9e-2 against ONNX Runtime, and
`make tune MODEL=bert` failed validation (found with
scripts/kernel_bisect.py; results/h200/2026-12-02/tune-bert-fp16-b1-seq/).

So after tuning, on the device, each workload's best record is built alone
and run on seeded inputs beside the same workload under default schedules
(the build's default chain on a GPU, passes/schedule.py; on the CPU TVM's
own unscheduled lowering, not our default schedule, which is code of ours
to be checked too). A record whose outputs differ
is **rejected**: listed in the database folder's `database_checks.json`
(committed with it), and every reader of the database (builds, the kernel
store, the search's seeds) skips it, so the next-best record is checked and
applied instead. Records that passed are listed too and not checked again.

The same check times each best record against the kernel's default schedule
(the first of our schedule chain that applies: ours and DLight's on a GPU, our
CPU defaults, `deploy/passes/cpu_default.py`, on the CPU), built and run the
same way on the same inputs. Where the default is faster (a short tuning run
on the CPU, whose default convolutions are already register-blocked, finds
slower schedules for many kernels), the workload is listed under
`default_faster` with both times, and builds and the kernel store leave its
records at least as slow as that one out, so the kernel keeps its default
schedule; the search still seeds from them, and a faster record found
later is checked and timed in its turn.

(Over 500 lines: the check's state file, the builds it judges and the
timings it keeps are read and written together; split, each part would
reach into the other's state.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np

from .. import artifacts
from ..errors import error_line
from ..passes import tf32
from ..passes.schedule import MMA_GEMM
from ..targets import TargetInfo
from . import journal

log = logging.getLogger(__name__)
CHECKS = "database_checks.json"
# Largest ||tuned - default|| / ||default|| accepted, by output dtype: an
# fp16 kernel and its default schedule sum in another order and round each
# output; a wrong kernel is off by far more (the BERT one: see above).
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-3, "float64": 1e-6}
# An fp32 kernel marked for TF32 (passes/tf32.py): its inputs rounded to a
# 10-bit mantissa (~4e-4 of L2 in a long random sum against strict fp32).
TF32_TOLERANCE = 5e-3
ROUNDS = 3  # a workload whose best records keep failing: at most this many checked per run
TIMING_REPEATS = 5  # the tuned and the default kernel: median of this many repeats,
TIMING_REPEAT_MS = 20  # each calling it for at least this long
SAVE_EVERY = 16  # records built, judged and saved together (two rounds of 8 build processes)


def record_id(shash: str, rec: list) -> str:
    """A record's identity (its workload and trace, as the journal compares them)."""
    return hashlib.sha256(json.dumps(journal.identity(shash, rec)).encode()).hexdigest()[:24]


def read(folder: Path, kind: str | None = None) -> dict:
    """The folder's check state. Timings stay valid while the default chain
    (`schedule.default_chain` of `kind`, the target kind, else of the one the
    folder's key.json names) is the same up to and including the source that
    made the workload's default schedule ("default_rule"); those of the
    other workloads are dropped (which records were timed, which a default
    beat, the defaults' times), so the next check times them against today's
    defaults: a new rule before DLight's Fallback re-times only the kernels
    that went to the rules after it. Verdicts on what a record computes stay:
    every default computes the same."""
    path = Path(folder) / CHECKS
    state = json.loads(path.read_text()) if path.is_file() else {}
    if isinstance(state.get("timed"), list):  # (written before timings named their workload)
        state["timed"] = dict.fromkeys(state["timed"])
    for k in ("passed", "rejected", "default_faster"):
        state.setdefault(k, [])
    for k in ("timed", "default_rule"):
        state.setdefault(k, {})
    chain = _default_chain(Path(folder), kind)
    if chain is not None:
        old = state.pop("chain", None)
        if old is None:  # (one number for the whole chain, 1 where none was written)
            old = _LEGACY_CHAINS.get((kind or _kind(Path(folder)), state.get("defaults", 1)))
        state.pop("defaults", None)
        if old != chain:
            _drop_stale(state, old or [], chain)
        state["chain"] = chain
    return state


# The chains of databases checked when a target kind's whole chain had one
# version number: CUDA 4 and llvm 1 (no CPU rule had changed its kernels'
# schedules by then), every rule at version 1 (CUDA's rules of then, in their
# order of then); timings made under older CUDA numbers are dropped.
_LEGACY_CHAINS = {
    ("cuda", 4): ["few-outputs@1", "dlight.Matmul", "dlight.GEMV", "short-reduction@1", "dlight.Reduction",
                  "dlight.GeneralReduction", "broadcast-epilogue@1", "dlight.Fallback", "default"],
    ("llvm", 1): ["contraction@1", "dlight.Reduction", "injective@1", "default"],
}


def _drop_stale(state: dict, old: list[str], new: list[str]) -> None:
    """Timings of the workloads whose default might now come from another
    source (or another version of it) dropped from `state`, in place."""
    rules = state["default_rule"]
    names = [c.split("@")[0] for c in old]

    def valid(shash) -> bool:
        rule = rules.get(shash)
        if rule not in names:
            return False
        i = names.index(rule) + 1
        return old[:i] == new[:i]

    keep = {w for w in rules if valid(w)}
    state["default_rule"] = {w: r for w, r in rules.items() if w in keep}
    state["timed"] = {r: w for r, w in state["timed"].items() if w in keep}
    state["default_faster"] = [e for e in state["default_faster"] if e.get("workload") in keep]
    if "default_us" in state:
        state["default_us"] = {w: us for w, us in state["default_us"].items() if w in keep}


def _kind(folder: Path) -> str | None:
    try:
        return json.loads((folder / "key.json").read_text())["target"]["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _default_chain(folder: Path, kind: str | None) -> list[str] | None:
    """Today's default chain for `kind`, or for the target the folder's
    key.json names; None when neither says (nothing is dropped)."""
    from ..passes.schedule import default_chain

    kind = kind or _kind(folder)
    return default_chain(kind) if kind is not None else None


def drop_rejected(folder: Path, workloads: list[str], records: list[str], slower_than_default: bool = False
                  ) -> list[str]:
    """`records` less those the check rejected (their workload lines stay);
    with `slower_than_default` (builds and the kernel store), less those of a
    workload whose default schedule beat a record at least as fast."""
    from .database import _mean_secs

    state = read(folder)
    bad = {r["record"] for r in state["rejected"]}
    # A record's id is costly (its whole trace canonicalized: 4 s for ResNet-50's 3,700 records on the CPU
    # machine), so only the records of workloads with a rejected record get one; every workload where a
    # rejection does not name its workload (written before they did).
    bad_workloads = None if any("workload" not in r for r in state["rejected"]) else \
        {r["workload"] for r in state["rejected"]}
    slow: dict[str, float] = {}
    if slower_than_default:
        for r in state["default_faster"]:
            slow[r["workload"]] = min(slow.get(r["workload"], float("inf")), r["record_secs"])
    if not bad and not slow:
        return records
    shashes = [json.loads(w)[0] for w in workloads]
    out = []
    for ln in records:
        wi, rec = json.loads(ln)
        shash = shashes[wi]
        if bad and (bad_workloads is None or shash in bad_workloads) and record_id(shash, rec) in bad:
            continue
        if shash in slow and _mean_secs(rec) >= slow[shash]:
            continue
        out.append(ln)
    return out


def check_database(folder: Path, target: TargetInfo) -> dict:
    """Check (and time against its default schedule) each workload's best
    record not checked or not timed before; returns the counts of this call:
    {"checked", "passed", "rejected", "default_faster"}, and "unchecked"
    where a record could not be built or run alone."""
    from . import database as dbs

    folder = Path(folder)
    state = read(folder, target.kind)
    passed, timed = set(state["passed"]), state["timed"]
    counts = {"checked": 0, "passed": 0, "rejected": 0, "default_faster": 0}
    dev = target.device()
    tried: set[str] = set()
    for _ in range(ROUNDS):
        # (rejected records, and those the default schedule already beat, left out)
        workloads, records = dbs._best_lines(folder, 1, slower_than_default=True)
        todo = []
        for ln in records:
            wi, rec = json.loads(ln)
            shash = json.loads(workloads[wi])[0]
            rid = record_id(shash, rec)
            if dbs._mean_secs(rec) != float("inf") and (rid not in passed or rid not in timed) and rid not in tried:
                todo.append((workloads[wi], rec, shash, rid))
        if not todo:
            break
        tried.update(t[3] for t in todo)
        # (in batches, each saved once judged: a run stopped mid-check, e.g. at a device
        # chunk's time limit, keeps the verdicts and timings of the batches done)
        for start in range(0, len(todo), SAVE_EVERY):
            batch = todo[start:start + SAVE_EVERY]
            for (wl_line, rec, shash, rid), built in zip(batch, _build_all(batch, passed, target)):
                _judge_one(state, counts, passed, timed, wl_line, rec, shash, rid, built, target, dev)
            state["passed"], state["timed"] = sorted(passed), dict(sorted(timed.items()))
            artifacts.write_json_atomic(folder / CHECKS, state)
    return counts


def _judge_one(state, counts, passed, timed, wl_line, rec, shash, rid, built, target, dev) -> None:
    """One record checked and timed against its default (built here when
    `built` is None); `state`, `counts` and the sets updated in place."""
    from . import database as dbs

    counts["checked"] += 1
    try:
        if built is None:
            err = compare(wl_line, rec, target, dev, check_outputs=rid not in passed)
        elif "error" in built:
            raise RuntimeError(built["error"])
        else:
            err = judge(built, target, dev, check_outputs=rid not in passed)
    except Exception as e:  # noqa: BLE001 - a record that cannot be built or run alone is left unjudged
        log.warning("check: workload %s: not checked (%s)", shash,
                    (str(e).strip().splitlines() or [type(e).__name__])[0][:200])
        counts["unchecked"] = counts.get("unchecked", 0) + 1
        return  # (not listed: the next run tries again)
    if not err["ok"]:
        state["rejected"].append({"record": rid, "workload": shash, **err})
        counts["rejected"] += 1
        log.warning("check: workload %s: the tuned kernel computes something else than its default "
                    "schedule (rel_l2 %.2e on %s); rejected, the next-best record is used",
                    shash, err["rel_l2"], err["output"])
        return
    if rid not in passed:
        passed.add(rid)
        counts["passed"] += 1
    timed[rid] = shash
    if err.get("default_rule"):
        state["default_rule"][shash] = err["default_rule"]
    if err["default_us"] is not None and err["tuned_us"] is not None and err["default_us"] < err["tuned_us"]:
        state["default_faster"].append({"record": rid, "workload": shash, "record_secs": dbs._mean_secs(rec),
                                        "tuned_us": err["tuned_us"], "default_us": err["default_us"]})
        counts["default_faster"] += 1
        log.info("check: workload %s: its default schedule is faster than the best tuned kernel "
                 "(%.1f us against %.1f us); the build keeps the default", shash, err["default_us"], err["tuned_us"])


def compare(wl_line: str, rec: list, target: TargetInfo, dev, check_outputs: bool = True) -> dict:
    """Build the workload with the record's trace and with its default
    schedule (the first source of the schedule chain that builds, as a build
    would take it); run the record's kernel and a reference (on the CPU,
    TVM's own unscheduled lowering; on a GPU, the default) on the same seeded
    arguments and compare every argument after the run (the outputs; the
    inputs are left as they were); then, if they agree, time the record's
    kernel and the default one (`tuned_us`, `default_us`; both None when the
    outputs differ, `default_us` None when no default builds)."""
    return judge(build_libs(wl_line, rec, target, check_outputs), target, dev, check_outputs)


def build_libs(wl_line: str, rec: list, target: TargetInfo, check_outputs: bool = True) -> dict:
    """compare()'s builds: {"buffers": the arguments, "tuned": the record's
    kernel, "default": the default schedule's (absent when none builds),
    "default_rule": the source of the schedule chain that made it,
    "reference": what the outputs are compared with (absent when not
    checked or none builds)}."""
    from ..build import build_kernel
    from ..tvm_compat import ms, register_tensor_intrinsics, s_tir

    if "tensorize" in json.dumps(rec[0]).lower():
        register_tensor_intrinsics()  # tensor-core traces name TVM's intrinsics (wmma_fill_16x16x16_f32, ...)
    workload = ms.database.Workload.from_json(json.loads(wl_line))
    func = workload.mod["main"]  # (its arguments: the record's args_info)
    record = ms.database.TuningRecord.from_json(rec, workload)
    sch = s_tir.Schedule(workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    tuned = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    libs = {"buffers": [(f"argument {k}", str(a[1]), [int(d) for d in a[2]]) for k, a in enumerate(rec[3])],
            "tf32": tf32.allowed(func), "index_bounds": index_bounds(func)}
    with target.tvm_target():
        libs["tuned"] = build_kernel("main", tuned, target)
        default, plain, libs["default_rule"] = _default_lib(func, target)
        if default is not None:
            libs["default"] = default
        # The reference of the outputs: on the CPU, TVM's own lowering of the kernel (plain loops: slow, but
        # nothing of ours to trust); on a GPU, which needs a schedule, the default one, unless that is our
        # mma.sync GEMM, which tuned records of that schedule would be compared with: then the next source
        # of the chain (DLight's Matmul), independent of it.
        if check_outputs and target.kind != "cuda":
            libs["reference"] = default if plain else build_kernel("main", func, target)
        elif check_outputs and libs["default_rule"] == MMA_GEMM:
            other, _, _ = _default_lib(func, target, skip=(MMA_GEMM,))
            if other is not None:
                libs["reference"] = other
        elif check_outputs and default is not None:
            libs["reference"] = default
    return libs


def judge(libs: dict, target: TargetInfo, dev, check_outputs: bool = True) -> dict:
    """compare()'s runs on this machine's device, with build_libs()'s kernels."""
    from ..tvm_compat import tensor

    buffers = libs["buffers"]
    args = _seeded_args(buffers, libs.get("index_bounds"))
    worst = {"ok": True, "rel_l2": 0.0, "output": ""}
    if check_outputs:
        if "reference" not in libs:
            raise RuntimeError("no default schedule of this kernel builds: nothing to compare with")
        outs = []
        for lib in (libs["tuned"], libs["reference"]):
            ts = [tensor(a, dev) for a in args]
            lib["main"](*ts)
            dev.sync()
            outs.append([t.numpy() for t in ts])
        worst = _worst(buffers, *outs, tf32=libs.get("tf32", False))
        if not worst["ok"]:
            return {**worst, "tuned_us": None, "default_us": None}
    timed = [libs["tuned"]] + ([libs["default"]] if "default" in libs else [])
    us = _time_us_in_turns(timed, [[tensor(a, dev) for a in args] for _ in timed], dev)
    return {**worst, "default_rule": libs.get("default_rule"), "tuned_us": us[0],
            "default_us": us[1] if len(us) > 1 else None}


def _build_all(todo, passed: set, target: TargetInfo) -> list[dict | None]:
    """build_libs() for every record to check, in parallel processes where
    there are many (on the H200 each check spent ~4.6 s, most of it building
    two kernels with NVRTC one after the other: 40 records of ResNet-50 took
    185 s on a fresh machine, results/h200/2026-12-03/resnet50-time-to-package);
    a record whose builds failed gets {"error": its first line}. Few records:
    None each, compare() builds them here."""
    import tempfile

    from ..errors import run_in_processes
    from ..tvm_compat import load_module

    workers = _build_workers(len(todo))
    if workers <= 1:
        return [None] * len(todo)
    with tempfile.TemporaryDirectory(prefix="tvm-deploy-check-") as tmp:
        jobs = [(wl_line, rec, target, rid not in passed, str(Path(tmp) / str(k)))
                for k, (wl_line, rec, _shash, rid) in enumerate(todo)]
        try:
            built = run_in_processes(_build_exported, jobs, workers)
        except Exception as e:  # noqa: BLE001 - a build process died (a crash in codegen, killed for memory)
            return [{"error": f"build processes failed: {error_line(e, 200)}"}] * len(todo)
        out = []
        for b in built:
            try:  # (loaded, the files can go: the modules stay in memory)
                out.append(b if "error" in b else {
                    **{k: load_module(v) for k, v in b.items() if k not in _META},
                    **{k: b[k] for k in _META}})
            except Exception as e:  # noqa: BLE001
                out.append({"error": error_line(e, 200)})
        return out


_META = ("buffers", "default_rule", "tf32", "index_bounds")  # build_libs()' entries that are not kernels


def _build_exported(job) -> dict:
    """Build-process entry: build_libs(), each kernel exported to a file
    (a reference that is the default schedule itself shares its file)."""
    wl_line, rec, target, check_outputs, stem = job
    try:
        libs = build_libs(wl_line, rec, target, check_outputs)
        out = {k: libs.pop(k) for k in _META}
        for name, lib in libs.items():
            same = next((k for k, v in libs.items() if v is lib and k in out), None)
            if same is not None:
                out[name] = out[same]
                continue
            out[name] = f"{stem}-{name}.so"
            lib.export_library(out[name])
        return out
    except Exception as e:  # noqa: BLE001 - reported by the caller, as "not checked"
        return {"error": error_line(e, 200)}


def _default_lib(func, target: TargetInfo, skip=()):
    """The kernel built with its default schedule (the first source of the
    schedule chain that builds, as a build would take it, less the sources
    in `skip`), whether that source is the unscheduled function itself, and
    the source's name; (None, False, None) if none builds."""
    from ..build import build_kernel
    from ..passes import schedule

    for name, f in schedule._sources(None, func, None, target.tvm_target(), target.kind):
        if isinstance(f, Exception) or name in skip:
            continue
        try:
            return build_kernel("main", f, target), f is func, name
        except Exception:  # noqa: BLE001 - as the build does: the next source
            continue
    return None, False, None


def _seeded_args(buffers, bounds: dict[int, int] | None = None) -> list[np.ndarray]:
    """Seeded arguments (runtime.random_inputs, seed 0): floats standard
    normal, integers in [0, 10), or below `bounds[k]` for argument k
    (index_bounds: the rows of the table it indexes)."""
    from ..runtime import random_inputs

    bounds = bounds or {}
    return random_inputs([(shape, dtype, (-bounds[k], bounds[k]) if k in bounds else None)
                          for k, (_, dtype, shape) in enumerate(buffers)], None)


def index_bounds(func) -> dict[int, int]:
    """{k: n} for each integer argument k of `func` whose values index a
    dimension of n of another argument (a gather, `table[ids[i], j]`: TVM's
    `take` does not check them), n the smallest such; the kernel check's
    integers stay below it. A 2-row token-type table was read out of bounds
    by ids in [0, 10)."""
    import re

    from ..passes.mma_epilogue import _blocks
    from ..tvm_compat import tirx

    ints = {b.name: k for k, b in enumerate(func.params) if str(b.dtype).startswith(("int", "uint"))}
    out: dict[int, int] = {}
    for block in _blocks(func.body) if ints else []:
        for read in block.reads:  # (a block's read region: its buffer is `source`)
            for rng, extent in zip(read.region, read.source.shape):
                if not isinstance(extent, tirx.IntImm):
                    continue
                text = str(rng.min)
                for name, k in ints.items():
                    if name != read.source.name and re.search(rf"\b{re.escape(name)}\[", text):
                        out[k] = min(out.get(k, int(extent)), int(extent))
    return out


def time_defaults(folder: Path, tasks: list[dict], target: TargetInfo) -> dict[str, float]:
    """Microseconds of one call of each task's kernel under its default
    schedule, timed on this machine's device; {task name: us} for those that
    built. `tasks` are tune plans' entries ({"name", "mod"}). Times are kept
    per workload in the folder's database_checks.json ("default_us") and not
    measured again. The tune stage tunes the slowest untuned kernels first:
    FLOPs do not say which default schedules are slow (EfficientNet-B0 at
    batch 1: a squeeze-excitation 1x1 convolution of 0.4 MFLOP took 338 us
    under DLight, 13% of the model). The kernels are built in parallel
    processes where there are many (each ~1-2 s of NVRTC on a GPU), then
    timed here one at a time."""
    import tempfile

    from ..errors import run_in_processes
    from ..tvm_compat import load_module, tensor, tvm

    folder = Path(folder)
    state = read(folder, target.kind)
    cached = state.setdefault("default_us", {})
    hashes = _task_hashes(tasks)
    todo = [t for t in tasks if hashes[t["name"]] not in cached]
    if todo:
        dev = target.device()
        workers = _build_workers(len(todo))
        with tempfile.TemporaryDirectory(prefix="tvm-deploy-defaults-") as tmp:
            jobs = [(tvm.ir.save_json(t["mod"]), target, str(Path(tmp) / f"{k}.so")) for k, t in enumerate(todo)]
            built = run_in_processes(_build_default, jobs, workers)
            for t, (path, rule) in zip(todo, built):
                us = None  # (kept as None: not built again next run; ranked by its FLOPs instead)
                if rule is not None:
                    state["default_rule"][hashes[t["name"]]] = rule
                if path is not None:
                    try:
                        main = t["mod"]["main"]
                        args = _seeded_args(_buffers(main), index_bounds(main))
                        us = _time_us(load_module(path), [tensor(a, dev) for a in args], dev)
                    except Exception as e:  # noqa: BLE001
                        log.debug("check: %s: default schedule not timed (%s)", t["name"], e)
                cached[hashes[t["name"]]] = us
        folder.mkdir(parents=True, exist_ok=True)  # (before a new database's first record: tuning opens it as is)
        artifacts.write_json_atomic(folder / CHECKS, state)
    return {t["name"]: cached[hashes[t["name"]]] for t in tasks if cached.get(hashes[t["name"]]) is not None}


def cached_default_us(folder: Path, tasks: list[dict], kind: str) -> dict[str, float] | None:
    """time_defaults()' times of these tasks (its entries, {"name", "mod"})
    as the folder keeps them, {task name: us} for those whose default built;
    None unless every task was timed (a partial cache would rank the timed
    tasks first whatever their times). Nothing is built or timed."""
    cached = read(Path(folder), kind).get("default_us") or {}
    if not cached:
        return None
    hashes = _task_hashes(tasks)
    if any(h not in cached for h in hashes.values()):
        return None
    return {name: cached[h] for name, h in hashes.items() if cached[h] is not None}


def _task_hashes(tasks: list[dict]) -> dict[str, str]:
    """{task name: its workload's structural hash, as the database keys it}."""
    from .store import workload_hashes

    return {t["name"]: next(iter(workload_hashes([t["mod"]]))) for t in tasks}


PARALLEL_BUILDS = 8  # build processes for time_defaults and check_database, from PARALLEL_FROM kernels on
PARALLEL_FROM = 8


def _build_workers(n: int) -> int:
    from .builder import usable_cpus

    return min(PARALLEL_BUILDS, usable_cpus(), n) if n >= PARALLEL_FROM else 1


def _buffers(func) -> list[tuple[str, str, list[int]]]:
    from ..tvm_compat import ms

    return [(f"argument {k}", str(a.dtype), [int(d) for d in a.shape])
            for k, a in enumerate(ms.arg_info.ArgInfo.from_prim_func(func))]


def _build_default(job) -> tuple[str | None, str | None]:
    """Build-process entry: the task module (JSON) built with its default
    schedule and exported to `path`; (path, the schedule's source), (None,
    None) where no default builds."""
    mod_json, target, path = job
    from ..tvm_compat import tvm

    try:
        with target.tvm_target():
            lib, _, rule = _default_lib(tvm.ir.load_json(mod_json)["main"], target)
        if lib is None:
            return None, None
        lib.export_library(path)
        return path, rule
    except Exception as e:  # noqa: BLE001 - untimed: ranked by its FLOPs instead
        log.debug("check: default schedule not built (%s)", e)
        return None, None


def _worst(buffers, got_all, want_all, tf32: bool = False) -> dict:
    """The argument that differs most (relative L2), and whether it is
    within its dtype's tolerance (TF32's for fp32 where `tf32`)."""
    worst = {"ok": True, "rel_l2": 0.0, "output": ""}
    for (name, dtype, _), got, want in zip(buffers, got_all, want_all):
        if np.array_equal(got, want, equal_nan=True):
            continue
        g, w = got.astype("float64"), want.astype("float64")
        finite = np.isfinite(w)
        if not np.array_equal(np.isfinite(g), finite):
            return {"ok": False, "rel_l2": float("inf"), "output": name}
        rel = float(np.linalg.norm((g - w)[finite]) / max(np.linalg.norm(w[finite]), 1e-30))
        tol = TF32_TOLERANCE if tf32 and dtype == "float32" else TOLERANCE.get(dtype, 0.0)
        if rel > worst["rel_l2"]:
            worst = {"ok": rel <= tol, "rel_l2": rel, "output": name}
        if rel > tol:
            return {"ok": False, "rel_l2": rel, "output": name}
    return worst


def _time_us(lib, args, dev) -> float:
    """Median microseconds of one call, each repeat long enough to time."""
    return _time_us_in_turns([lib], [args], dev)[0]


def _time_us_in_turns(libs, args, dev) -> list[float]:
    """Each kernel's median microseconds of one call over TIMING_REPEATS
    repeats, the kernels taking turns repeat by repeat (runtime.latency_in_turns;
    each repeat long enough to time): the tuned kernel and its default
    schedule see the same machine. One timed after the other, a 2-core VM
    whose speed moved by up to 2x within seconds judged kernels by when they
    ran (results/cpu/2026-12-08/timed-in-turns/)."""
    from ..runtime import Timer, latency_in_turns

    timers = []
    for lib, a in zip(libs, args):  # (calls a repeat fixed once: min_repeat_ms would search for it every repeat)
        once = float(lib.time_evaluator("main", dev, number=1, repeat=1)(*a).mean)
        number = max(1, math.ceil(TIMING_REPEAT_MS / 1e3 / max(once, 1e-7)))
        timers.append(Timer(lib.time_evaluator("main", dev, number=number, repeat=1), a, number, TIMING_REPEATS))
    return [round(t["median_ms"] * 1e3, 3) for t in latency_in_turns(timers, TIMING_REPEATS)]
