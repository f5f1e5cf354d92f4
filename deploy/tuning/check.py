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
(DLight on a GPU; on the CPU TVM's own unscheduled lowering, not our
default schedule, which is code of ours to be checked too). A record whose outputs differ
is **rejected**: listed in the database folder's `database_checks.json`
(committed with it), and every reader of the database (builds, the kernel
store, the search's seeds) skips it, so the next-best record is checked and
applied instead. Records that passed are listed too and not checked again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from .. import artifacts
from ..targets import TargetInfo
from . import journal

log = logging.getLogger(__name__)
CHECKS = "database_checks.json"
# Largest ||tuned - default|| / ||default|| accepted, by output dtype: an
# fp16 kernel and its default schedule sum in another order and round each
# output; a wrong kernel is off by far more (the BERT one: see above).
TOLERANCE = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-3, "float64": 1e-6}
ROUNDS = 3  # a workload whose best records keep failing: at most this many checked per run


def record_id(shash: str, rec: list) -> str:
    """A record's identity (its workload and trace, as the journal compares them)."""
    return hashlib.sha256(json.dumps(journal.identity(shash, rec)).encode()).hexdigest()[:24]


def read(folder: Path) -> dict:
    path = Path(folder) / CHECKS
    if not path.is_file():
        return {"passed": [], "rejected": []}
    return json.loads(path.read_text())


def rejected_ids(folder: Path) -> set[str]:
    return {r["record"] for r in read(folder)["rejected"]}


def drop_rejected(folder: Path, workloads: list[str], records: list[str]) -> list[str]:
    """`records` less those the check rejected (their workload lines stay)."""
    bad = rejected_ids(folder)
    if not bad:
        return records
    out = []
    for ln in records:
        wi, rec = json.loads(ln)
        if record_id(json.loads(workloads[wi])[0], rec) not in bad:
            out.append(ln)
    return out


def check_database(folder: Path, target: TargetInfo) -> dict:
    """Check each workload's best record not checked before; returns
    {"checked", "passed", "rejected"} counts of this call."""
    from . import database as dbs

    folder = Path(folder)
    state = read(folder)
    passed = set(state["passed"])
    counts = {"checked": 0, "passed": 0, "rejected": 0}
    dev = target.device()
    tried: set[str] = set()
    for _ in range(ROUNDS):
        workloads, records = dbs._best_lines(folder, 1)  # rejected records already left out
        todo = []
        for ln in records:
            wi, rec = json.loads(ln)
            shash = json.loads(workloads[wi])[0]
            if dbs._mean_secs(rec) != float("inf") and record_id(shash, rec) not in passed:
                todo.append((workloads[wi], rec, shash))
        todo = [t for t in todo if record_id(t[2], t[1]) not in tried]
        if not todo:
            break
        tried.update(record_id(t[2], t[1]) for t in todo)
        for wl_line, rec, shash in todo:
            rid = record_id(shash, rec)
            counts["checked"] += 1
            try:
                err = compare(wl_line, rec, target, dev)
            except Exception as e:  # noqa: BLE001 - a record that cannot be built or run alone is left unjudged
                log.warning("check: workload %s: not checked (%s)", shash, str(e).splitlines()[0][:200])
                counts["unchecked"] = counts.get("unchecked", 0) + 1
                continue  # (not listed: the next run tries again)
            if err["ok"]:
                passed.add(rid)
                counts["passed"] += 1
            else:
                state["rejected"].append({"record": rid, "workload": shash, **err})
                counts["rejected"] += 1
                log.warning("check: workload %s: the tuned kernel computes something else than its default "
                            "schedule (rel_l2 %.2e on %s); rejected, the next-best record is used",
                            shash, err["rel_l2"], err["output"])
        state["passed"] = sorted(passed)
        artifacts.write_json_atomic(folder / CHECKS, state)
    return counts


def compare(wl_line: str, rec: list, target: TargetInfo, dev) -> dict:
    """Build the workload with the record's trace and with its default
    schedule, run both on the same seeded arguments, compare every argument
    after the run (the outputs; the inputs are left as they were)."""
    from ..build import build_kernel
    from ..passes import schedule
    from ..tvm_compat import ms, register_tensor_intrinsics, s_tir, tensor

    if "tensorize" in json.dumps(rec[0]).lower():
        register_tensor_intrinsics()  # tensor-core traces name TVM's intrinsics (wmma_fill_16x16x16_f32, ...)
    workload = ms.database.Workload.from_json(json.loads(wl_line))
    func = workload.mod["main"]  # (its arguments: the record's args_info)
    record = ms.database.TuningRecord.from_json(rec, workload)
    sch = s_tir.Schedule(workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    tuned = sch.mod["main"].with_attr("tirx.is_scheduled", True)
    # The reference: on the CPU, TVM's own lowering of the kernel (plain loops: slow, but nothing of ours
    # to trust); on a GPU, which needs a schedule, the first DLight rule that applies.
    reference = func if target.kind != "cuda" else None
    for _name, f in [] if reference is not None else schedule._sources(None, func, None, target.tvm_target(), target.kind):
        if not isinstance(f, Exception):
            reference = f
            break
    buffers = [(f"argument {k}", str(a[1]), [int(d) for d in a[2]]) for k, a in enumerate(rec[3])]  # args_info
    rng = np.random.default_rng(0)
    args = []
    for _, dtype, shape in buffers:
        args.append(rng.standard_normal(shape).astype(dtype) if dtype.startswith(("float", "bfloat"))
                    else rng.integers(0, 10, shape).astype(dtype))
    with target.tvm_target():
        outs = []
        for f in (tuned, reference):
            lib = build_kernel("main", f, target)
            ts = [tensor(a, dev) for a in args]
            lib["main"](*ts)
            dev.sync()
            outs.append([t.numpy() for t in ts])
    worst = {"ok": True, "rel_l2": 0.0, "output": ""}
    for (name, dtype, _), got, want in zip(buffers, *outs):
        if np.array_equal(got, want, equal_nan=True):
            continue
        g, w = got.astype("float64"), want.astype("float64")
        finite = np.isfinite(w)
        if not np.array_equal(np.isfinite(g), finite):
            return {"ok": False, "rel_l2": float("inf"), "output": name}
        rel = float(np.linalg.norm((g - w)[finite]) / max(np.linalg.norm(w[finite]), 1e-30))
        tol = TOLERANCE.get(dtype, 0.0)
        if rel > worst["rel_l2"]:
            worst = {"ok": rel <= tol, "rel_l2": rel, "output": name}
        if rel > tol:
            return {"ok": False, "rel_l2": rel, "output": name}
    return worst
