"""MetaSchedule on llvm: one small task, a handful of trials, then resumed.
(The first TuneContext of a process imports TVM's tensor intrinsics: ~60 s here.)"""

import json
import os
import time

import pytest

from deploy.errors import DatabaseMismatchError
from deploy.tuning import builder as tune_builder
from deploy.tuning import database as dbs
from deploy.tuning import tasks as tune_tasks
from deploy.tuning import tune

from ..conftest import make_config


@pytest.fixture(scope="module")
def tiny_opt(tiny_package):
    from deploy import export, optimize

    ws = tiny_package[0].parent
    return export.load(ws / "export"), optimize.load(ws / "optimize")


def _tune(cfg, target, exported, opt, db_root, folder, budget_s=None, pool=None):
    a = tune.run(cfg.llvm, target, opt, cfg.model.name, exported.inputs, db_root, folder, budget_s, pool=pool)
    return json.loads((a.folder / "summary.json").read_text())["1"], a


def test_tune_one_task_then_resume(tmp_path, llvm_target, tiny_opt):
    exported, opt = tiny_opt
    db_root = tmp_path / "db"
    cfg = make_config(trials=2, trials_per_task=2, trials_per_iter=2, max_tasks=1)
    from deploy.tuning import pool as rpc_pool

    # (make tune's loopback pool of 2 lanes: one task to tune is one lane, measured here without it)
    lazy = rpc_pool.LazyLoopback(2, 0, tmp_path / "rpc-loopback")
    s1, a1 = _tune(cfg, llvm_target, exported, opt, db_root, tmp_path / "t1", pool=lazy)
    assert lazy.started is None and not (tmp_path / "rpc-loopback").exists()
    (name,) = s1["tasks"]
    assert s1["tasks_selected"] == 1 and s1["tasks_total"] > 1
    assert s1["new_trials"] == 2 and s1["trials_after"] == 2
    assert s1["tasks"][name]["best_us"] is not None
    assert s1["valid_fraction"] == 1.0
    # a new database says which graph it was tuned on (tuning/graph.py): on the CPU, direct convolutions
    assert json.loads((a1.databases[1] / "graph.json").read_text()) == {"convolutions": "direct"}
    # the tuned kernel was built alone and compared with its default schedule, on this device
    # and timed against it (which is faster on this machine decides, so either count is right)
    kc = s1["kernel_check"]
    assert (kc["checked"], kc["passed"], kc["rejected"]) == (1, 1, 0) and kc["default_faster"] in (0, 1)
    checks = json.loads((a1.databases[1] / "database_checks.json").read_text())
    assert len(checks["timed"]) == 1 and len(checks["default_faster"]) == kc["default_faster"]
    # before tuning, every task's kernel was timed under its default schedule (which one MAX_TASKS=1 keeps)
    assert len(checks["default_us"]) == s1["tasks_total"] and all(v is None or v > 0 for v in
                                                                  checks["default_us"].values())
    # where the time went, from MetaSchedule's profiler
    assert s1["time_split_s"] and all(v >= 0 for v in s1["time_split_s"].values())
    from deploy import pipeline

    text = pipeline.format_summary({"package": "p", "buckets": {}, "tuning": {"1": s1}, "validation": None})
    assert "2 trials in database (2 new, 100% valid, 1/" in text and "s tuning: build" in text
    # how long each candidate took to build in the workers, and what the batches waited
    b = s1["build"]
    assert b["candidates"] == 2 and b["batches"] == 1 and 0 < b["candidate_p50_s"] <= b["candidate_max_s"]
    assert 0 < b["busy"] <= 1 and b["candidate_sum_s"] <= b["wall_s"] * b["workers"]
    assert b["failed"] == b["timed_out"] == 0
    assert "building: 2 candidates built in 1 batch(es), " in text and "build_times" not in s1
    b0 = tune_builder.build_stats({"batch_wall_s": [3.0], "candidate_s": [1.0], "workers": 4, "failed": 2, "timed_out": 1})
    assert (b0["failed"], b0["timed_out"], b0["busy"]) == (2, 1, round(1.0 / 12, 3))
    text = pipeline.format_summary({"package": "p", "buckets": {}, "validation": None,
                                    "tuning": {"1": {**s1, "build": b0}}})
    assert "(2 failed, 1 timed out)" in text
    text = pipeline.format_summary({"package": "p", "buckets": {}, "validation": None,
                                    "tuning": {"1": {**s1, "own_spaces": {"fused_conv2d": "short-reduction"}}}})
    assert ", 1 with our short-reduction space)" in text
    text = pipeline.format_summary({"package": "p", "buckets": {}, "validation": None, "tuning": {"1": {
        **s1, "own_spaces": {"fused_conv2d": "short-reduction", "fused_matmul": "mma-gemm", "matmul": "mma-gemm"}}}})
    assert ", 1 with our short-reduction space, 2 with our mma.sync GEMM)" in text
    db_dir = a1.databases[1]
    key = json.loads((db_dir / "key.json").read_text())
    assert key["precision"] == "fp32" and key["inputs"][0]["shape"] == [1, 3, 16, 16]
    # Packed when the run ended: compressed files only, no working copy left.
    assert not (db_dir / dbs.RECORDS).exists() and (db_dir / (dbs.RECORDS + dbs.PACKED)).is_file()
    assert len(dbs._packed_lines(db_dir / (dbs.RECORDS + dbs.PACKED))) == 2

    # The run refreshed the kernel store: another model with the same kernel
    # (here the same module, built with no database of its own) gets its record.
    import dataclasses

    from deploy import build
    from deploy.tuning import store

    if checks["default_faster"]:  # (the store leaves such a record out: test_..._slower_than_its_default_...)
        (db_dir / "database_checks.json").write_text(json.dumps({**checks, "default_faster": []}))
        store.refresh(db_root)
    assert dbs.hashes_of(store.lines_for(db_root, llvm_target)) and store.digest(db_root, llvm_target)
    one = dataclasses.replace(cfg.llvm, buckets=(1,))  # built in this process, whose TVM has the intrinsics already
    other = build.run(one, llvm_target, exported, opt, {}, {}, tmp_path / "other", "other", store_root=db_root)
    b1 = other.manifest["buckets"]["1"]
    assert b1["tuned_kernels"] == 1 and b1["database"] is None
    assert b1["store"]["kernels"] == 1 and b1["store"]["not_in_database"] == 1
    assert b1["store"]["digest"] == store.digest(db_root, llvm_target)
    text = pipeline.format_summary({"package": "p", "buckets": {"1": b1}, "validation": None})
    assert "1/" in text and "(1 by other models, from the kernel store)" in text
    # The same bucket with its own database: the store adds nothing new.
    keys = {1: json.loads((a1.databases[1] / "key.json").read_text())}
    own = build.run(one, llvm_target, exported, opt, a1.databases, keys, tmp_path / "own", cfg.model.name,
                    store_root=db_root)
    assert own.manifest["buckets"]["1"]["store"]["not_in_database"] == 0
    # how much of its database the module uses: its one tuned kernel, nothing stale
    mine = own.manifest["buckets"]["1"]
    assert (mine["database"]["kernels_with_records"], mine["database"]["records_of_other_kernels"]) == (1, 0)
    assert build.stale_database(mine) is None

    # Same budget again: the task has reached it, nothing is redone, and the
    # loopback pool of lanes is not started.
    s2, a2 = _tune(cfg, llvm_target, exported, opt, db_root, tmp_path / "t2", pool=lazy)
    assert lazy.started is None and not (tmp_path / "rpc-loopback").exists()
    assert a2.manifest["rpc"] is None
    assert s2["new_trials"] == 0 and s2["trials_after"] == 2
    text = pipeline.format_summary({"package": "p", "buckets": {}, "tuning": {"1": s2}, "validation": None})
    assert "done: it holds TRIALS=2 (a larger TRIALS tunes on)" in text

    # A killed run leaves its working copy, perhaps with a torn last line:
    # folded in on the next open, the torn line dropped, the records kept.
    dbs._expand(db_dir, db_dir)
    with open(db_dir / dbs.RECORDS, "a") as f:
        f.write('[0, ["torn')
    # A larger budget resumes: only the missing trials run, on top of the old records.
    cfg4 = make_config(trials=4, trials_per_task=4, trials_per_iter=2, max_tasks=1)
    s3, _ = _tune(cfg4, llvm_target, exported, opt, db_root, tmp_path / "t3")
    assert s3["trials_before"] == 2
    assert s3["new_trials"] == 2 and s3["trials_after"] == 4
    assert s3["tasks"][name]["best_us_before_run"] is not None
    # The cost model learnt from the records already there before its first batch.
    assert s1["cost_model_warm_start"]["records"] == 0
    assert s3["cost_model_warm_start"]["records"] == 2


def test_deadline_stops_cleanly(tmp_path, llvm_target, tiny_opt):
    exported, opt = tiny_opt
    cfg = make_config(trials=64, trials_per_task=32, trials_per_iter=2, max_tasks=1)
    s, a = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t", budget_s=0.001)
    assert s["new_trials"] == 0
    assert (a.folder / "manifest.json").is_file()


def test_first_interrupt_saves_every_candidate_built(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """The first SIGINT while tuning (Ctrl-C, or gpu_chunk.sh's `timeout
    --signal=INT`) stops new candidates, and every candidate already built
    is measured and saved, also batches MetaSchedule had not come back to
    yet; then the run ends as Ctrl-C ends it, the usual handler back."""
    import contextlib
    import signal

    import psutil

    exported, opt = tiny_opt
    built = []
    real = tune_builder._make_builder

    def make(*args, **kwargs):
        b = real(*args, **kwargs)
        inner = b._inst.build  # the Python method (b.build is the FFI one, which calls back into this)

        def build(inputs):
            out = inner(inputs)
            built.append(len(inputs))
            if len(built) == 2:  # both tasks have a batch built, neither saved yet
                # As Ctrl-C or `timeout --signal=INT` do: the whole process
                # group, here this process and its workers (not pytest's parents).
                for child in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.send_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
            return out

        b.build = build
        return b

    monkeypatch.setattr(tune_builder, "_make_builder", make)
    # Python's own SIGINT handler to start from, whatever an earlier test left in this process
    # (a build worker's initializer run here ignores SIGINT: test_build_workers_get_nvrtc_pch_options_...)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = make_config(trials=16, trials_per_task=8, trials_per_iter=2, max_tasks=2)
    with pytest.raises(KeyboardInterrupt):
        _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert built == [2, 2]  # no batch after the interrupt
    (db_dir,) = [d for d in (tmp_path / "db").rglob("key.json")]
    _, records = dbs._all_lines(db_dir.parent)
    assert len(records) == 4
    # ... and measured: the workers ignored the SIGINT (a killed one leaves a failed record, 1e10 s)
    assert all(max(json.loads(r)[1][1]) < 1e9 for r in records)


def test_database_for_another_target_is_refused(tmp_path, llvm_target, tiny_opt):
    exported, opt = tiny_opt
    cfg = make_config(trials=2, trials_per_task=2, max_tasks=1)
    key = dbs.database_key(cfg.model.name, exported.inputs, 1, cfg.llvm, llvm_target)
    db_dir = dbs.database_dir(tmp_path / "db", key, llvm_target)
    db_dir.mkdir(parents=True)
    other = dict(key, target={**key["target"], "arch": "sm_90", "kind": "cuda", "device": "NVIDIA H200"})
    (db_dir / "key.json").write_text(json.dumps(other))
    with pytest.raises(DatabaseMismatchError, match="made for another target"):
        _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_repair_jsonl(tmp_path):
    from deploy.errors import StaleArtifactError

    p = tmp_path / "r.json"
    p.write_text('[1, 2]\n[3, 4]\n[5, "cut')
    assert dbs.repair_jsonl(p) == 1
    assert p.read_text() == "[1, 2]\n[3, 4]\n"
    assert dbs.repair_jsonl(p) == 0
    p.write_text('[1, 2]\n[3, 4]')  # killed before the newline: complete, but the next append would join it
    assert dbs.repair_jsonl(p) == 0 and p.read_text() == "[1, 2]\n[3, 4]\n"
    w = tmp_path / "w.json"
    w.write_text('[1]\n[2, "bad\n[3]\n')
    with pytest.raises(StaleArtifactError, match="line 2"):
        dbs.repair_jsonl(w, only_last=True)


def test_failure_reason_is_the_compilers_first_error():
    """NVRTC's log ends with its error count or "Error limit reached.": the
    first error line is the reason recorded; TVM's own errors keep their
    check line."""

    nvrtc = """Traceback (most recent call last):
  File "tvm/contrib/nvcc.py", line 321, in compile_cuda_nvrtc
RuntimeError: NVRTC compilation failed:
default_program(112): error: too many resources requested for launch
default_program(140): error: identifier "x_shared" is undefined
Error limit reached.
100 errors detected in the compilation of "default_program".
Compilation terminated."""
    assert tune_tasks._failure_reason(nvrtc) == "CUDA compile: too many resources requested for launch"
    numbered = 'NVRTC compilation failed:\nkernel.cu(7): error #20-D: identifier "y" is undefined\n1 error detected'
    assert tune_tasks._failure_reason(numbered) == 'CUDA compile: identifier "y" is undefined'
    tvm_check = """Traceback (most recent call last):
  File "<unknown>", line 0, in tvm::ObjectMutator::Mutate(tvm::ffi::AnyView, tvm::ffi::InplaceMode)
tvm.error.InternalError: Check failed: (!load_remap_.count(alloc_key)) is false:"""
    assert tune_tasks._failure_reason(tvm_check) == "tvm.error.InternalError: Check failed: (!load_remap_.count(alloc_key)) is false:"


def test_build_workers_get_nvrtc_pch_options_only_from_a_new_enough_nvrtc(monkeypatch):
    import sys
    import types

    from deploy.tuning import builder as tune_builder

    def with_nvrtc(version):
        nvrtc = types.SimpleNamespace(nvrtcVersion=lambda: (0, *version))
        bindings = types.ModuleType("cuda.bindings")
        bindings.nvrtc = nvrtc
        monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.delenv("TVM_CUDA_NVRTC_EXTRA_OPTS", raising=False)
        tune_builder._build_worker_init()
        return os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS")

    # (the initializer also makes its process ignore SIGINT, as a worker should; not this one)
    monkeypatch.setattr(tune_builder, "ignore_sigint", lambda: None)

    assert with_nvrtc((13, 0)) == tune_builder.NVRTC_PCH_OPTS and "-pch" in tune_builder.NVRTC_PCH_OPTS
    assert with_nvrtc((12, 4)) is None  # may not take -pch: left as TVM has it
    monkeypatch.setenv("TVM_CUDA_NVRTC_EXTRA_OPTS", "")  # the user's choice (here: off) stands
    tune_builder._build_worker_init()
    assert os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] == ""


def test_sweep_removes_precompiled_headers_of_dead_workers_only(tmp_path):
    import subprocess
    import sys

    from deploy.tuning import builder as tune_builder

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    gone = tmp_path / f"__nvrtc_auto_pch_{int(dead.stdout)}_0"
    alive = tmp_path / f"__nvrtc_auto_pch_{os.getpid()}_0"
    other = tmp_path / "__nvrtc_auto_pch_notapid"
    for d in (gone, alive, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "pch").write_bytes(b"x" * 10)
    assert tune_builder.sweep_nvrtc_pch(str(tmp_path)) == 1
    assert not gone.exists() and alive.exists() and other.exists()


KILLED_RUN = """
import sys
from pathlib import Path

from deploy import export, optimize, targets
from deploy.tuning import tune
from tests.conftest import make_config

ws, db_root, folder = (Path(a) for a in sys.argv[1:4])
cfg = make_config(trials=16, trials_per_task=16, trials_per_iter=16, max_tasks=1)
exported = export.load(ws / "export")
tune.run(cfg.llvm, targets.resolve("llvm"), optimize.load(ws / "optimize"), cfg.model.name, exported.inputs,
         db_root, folder, None)
"""


def test_a_run_killed_mid_batch_loses_no_measured_candidate(tmp_path, tiny_package):
    """SIGKILL to a tuning run's whole process group (the out-of-memory
    killer, a GPU machine taken back) while it measures a batch of 16:
    MetaSchedule saves a batch only after measuring all of it, so without the
    journal every candidate measured so far was lost. After the kill, every
    candidate the run measured is in the database once it is packed."""
    import signal
    import subprocess
    import sys
    import time

    from deploy.artifacts import REPO_ROOT
    from deploy.tuning import journal

    ws = tiny_package[0].parent
    db_root = tmp_path / "db"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(ws), str(db_root), str(tmp_path / "t")],
                            cwd=REPO_ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})

    def measured():
        found = list(db_root.rglob(journal.MEASURED))
        if not found:
            return None, []
        _, records = journal.read(found[0])
        return found[0].parent, [r for _, r in records if max(r[1]) < 1e9]

    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        db_dir, done = measured()
        if len(done) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    db_dir, done = measured()
    assert 3 <= len(done) < 16  # killed mid-batch
    # MetaSchedule itself had saved none of them
    saved = (db_dir / dbs.RECORDS).read_text().splitlines() if (db_dir / dbs.RECORDS).is_file() else []
    assert saved == []
    assert dbs.pack(db_dir) >= len(done)
    _, records = dbs._all_lines(db_dir)
    have = {json.dumps(json.loads(r)[1][0]) for r in records}
    assert all(json.dumps(r[0]) in have for r in done)
    # ... and MetaSchedule reads every one of them back
    every = tmp_path / "every"
    every.mkdir()
    dbs._expand(db_dir, every)
    assert len(dbs._json_database(every).get_all_tuning_records()) == len(records)


def test_tuned_buckets_share_the_budget(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """Two tuned buckets: the first gets half the budget, not all of it; the
    second gets what is left (here the first ends at once: all of it)."""
    exported, opt = tiny_opt
    cfg = make_config(buckets=[1, 4], tune_buckets=[1, 4], trials=8)
    deadlines = []

    def fake(mod, db_dir, key, target, profile, deadline, *rest):
        deadlines.append(deadline - time.time())
        return {"new_trials": 0}

    monkeypatch.setattr(tune, "tune_bucket", fake)
    tune.run(cfg.llvm, llvm_target, opt, cfg.model.name, exported.inputs, tmp_path / "db", tmp_path / "t", 100.0)
    assert deadlines[0] == pytest.approx(50.0, abs=2) and deadlines[1] == pytest.approx(100.0, abs=3)


def test_a_tuned_kernel_that_computes_something_else_is_rejected(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """check.py: a record whose kernel differs from its default schedule is
    listed as rejected, builds and the kernel store no longer see it, and
    the workload's next-best record is checked in its place."""
    from deploy.tuning import check as kernel_check

    exported, opt = tiny_opt
    cfg = make_config(trials=4, trials_per_task=4, trials_per_iter=2, max_tasks=1)
    _, a = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t")
    db_dir = a.databases[1]
    (db_dir / kernel_check.CHECKS).unlink(missing_ok=True)
    workloads, best = dbs._best_lines(db_dir, 1)
    (wrong,) = best
    calls = []

    def compare(wl_line, rec, target, dev, check_outputs=True):
        calls.append(rec)
        bad = kernel_check.record_id(json.loads(wl_line)[0], rec) == kernel_check.record_id(
            json.loads(workloads[json.loads(wrong)[0]])[0], json.loads(wrong)[1])
        return {"ok": not bad, "rel_l2": 0.5 if bad else 0.0, "output": "argument 2", "tuned_us": 1.0,
                "default_us": 2.0}

    monkeypatch.setattr(kernel_check, "compare", compare)
    counts = kernel_check.check_database(db_dir, llvm_target)
    assert counts == {"checked": 2, "passed": 1, "rejected": 1, "default_faster": 0} and len(calls) == 2
    state = json.loads((db_dir / kernel_check.CHECKS).read_text())
    assert state["rejected"][0]["rel_l2"] == 0.5 and len(state["passed"]) == 1
    _, now = dbs._best_lines(db_dir, 1)
    assert now and wrong not in now  # the next-best record is what a build applies
    _, every = dbs._best_lines(db_dir, None)
    assert wrong not in every and len(every) == 3  # 4 trials, one rejected
    assert kernel_check.check_database(db_dir, llvm_target) == {"checked": 0, "passed": 0, "rejected": 0,
                                                                "default_faster": 0}


def _two_records_unchecked(tmp_path, llvm_target, tiny_opt):
    """A database of two tuned kernels whose check has not run."""
    from deploy.tuning import check as kernel_check

    exported, opt = tiny_opt
    cfg = make_config(trials=4, trials_per_task=2, trials_per_iter=2, max_tasks=2)
    _, a = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t")
    db_dir = a.databases[1]
    (db_dir / kernel_check.CHECKS).unlink(missing_ok=True)
    return db_dir


def test_many_kernels_to_check_are_built_in_parallel_processes(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """check.py: from PARALLEL_FROM records on, the tuned and default kernels
    are built in other processes and judged here, with the outcome of the
    one-process path; a record whose build fails there is left unchecked."""
    from deploy.tuning import check as kernel_check

    db_dir = _two_records_unchecked(tmp_path, llvm_target, tiny_opt)
    monkeypatch.setattr(kernel_check, "PARALLEL_FROM", 2)
    monkeypatch.setattr(kernel_check, "PARALLEL_BUILDS", 2)
    monkeypatch.setattr("deploy.tuning.builder.usable_cpus", lambda: 2)
    monkeypatch.setattr(kernel_check, "compare", lambda *a, **k: pytest.fail("built in this process"))
    counts = kernel_check.check_database(db_dir, llvm_target)
    assert counts["checked"] == 2 and counts["passed"] == 2 and counts["rejected"] == 0, counts
    state = kernel_check.read(db_dir)
    assert len(state["passed"]) == 2 and state["passed"] == sorted(state["timed"])
    assert set(state["timed"].values()) <= set(state["default_rule"])  # (each default's rule, from the processes)
    # a build that fails in a build process: its one line comes back; the record is not checked, not
    # listed, and tried again next run
    failed = kernel_check._build_exported(("not json", [], llvm_target, True, str(tmp_path / "k")))
    assert set(failed) == {"error"} and "\n" not in failed["error"]
    (db_dir / kernel_check.CHECKS).unlink()
    monkeypatch.setattr(kernel_check, "_build_all", lambda todo, *a: [failed] * len(todo))
    counts = kernel_check.check_database(db_dir, llvm_target)
    assert counts == {"checked": 2, "passed": 0, "rejected": 0, "default_faster": 0, "unchecked": 2}
    assert kernel_check.read(db_dir)["passed"] == []
    # the check of databases used without tuning (TRIALS=0 on a GPU): checked once, then skipped
    monkeypatch.undo()
    (counts,) = tune.check_databases([db_dir], llvm_target, tmp_path / "db").values()
    assert counts["checked"] == 2 and counts["passed"] == 2 and len(kernel_check.read(db_dir)["passed"]) == 2
    (again,) = tune.check_databases([db_dir], llvm_target, tmp_path / "db").values()
    assert again["checked"] == 0
    # and never stops the build that follows: a failure of the check itself is a warning
    monkeypatch.setattr(kernel_check, "check_database", lambda *a: (_ for _ in ()).throw(OSError("read-only")))
    assert tune.check_databases([db_dir], llvm_target, tmp_path / "db") == {}


def test_a_check_stopped_midway_keeps_the_batches_it_judged(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """check.py: records are built, judged and saved in batches of SAVE_EVERY;
    a run stopped in the second batch (a device chunk at its time limit) keeps
    the first batch's verdicts and timings, and the next run checks the rest."""
    from deploy.tuning import check as kernel_check

    db_dir = _two_records_unchecked(tmp_path, llvm_target, tiny_opt)
    monkeypatch.setattr(kernel_check, "SAVE_EVERY", 1)
    real, calls = kernel_check._judge_one, []

    def judge_then_stop(*args):
        if calls:
            raise KeyboardInterrupt
        calls.append(args)
        real(*args)

    monkeypatch.setattr(kernel_check, "_judge_one", judge_then_stop)
    with pytest.raises(KeyboardInterrupt):
        kernel_check.check_database(db_dir, llvm_target)
    state = kernel_check.read(db_dir)
    assert len(state["passed"]) == 1 and sorted(state["timed"]) == state["passed"]
    monkeypatch.setattr(kernel_check, "_judge_one", real)
    assert kernel_check.check_database(db_dir, llvm_target)["checked"] == 1
    assert len(kernel_check.read(db_dir)["timed"]) == 2


def test_a_tuned_kernel_slower_than_its_default_schedule_is_left_out_of_builds(tmp_path, llvm_target, tiny_opt,
                                                                                monkeypatch):
    """check.py: where the default schedule beats the best record, builds and
    the kernel store leave out that record and every slower one of the
    workload; tuning still seeds from them; a faster record found later is
    applied until it too is timed."""
    from deploy.tuning import check as kernel_check
    from deploy.tuning import store as kernel_store

    exported, opt = tiny_opt
    cfg = make_config(trials=4, trials_per_task=4, trials_per_iter=2, max_tasks=1)
    _, a = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t")
    db_dir = a.databases[1]
    (db_dir / kernel_check.CHECKS).unlink(missing_ok=True)
    _, every = dbs._best_lines(db_dir, None)
    secs = sorted(dbs._mean_secs(json.loads(ln)[1]) for ln in every)
    timed = []

    def compare(wl_line, rec, target, dev, check_outputs=True):
        timed.append(check_outputs)
        return {"ok": True, "rel_l2": 0.0, "output": "", "tuned_us": dbs._mean_secs(rec) * 1e6,
                "default_us": secs[0] * 1e6 / 2}  # twice as fast as the best record

    monkeypatch.setattr(kernel_check, "compare", compare)
    counts = kernel_check.check_database(db_dir, llvm_target)
    assert counts == {"checked": 1, "passed": 1, "rejected": 0, "default_faster": 1} and timed == [True]
    assert dbs._best_lines(db_dir, 1, slower_than_default=True)[1] == []  # the build keeps the default schedule
    assert len(dbs._all_lines(db_dir)[1]) == 4  # the search still sees them all
    kernel_store.refresh(tmp_path / "db")
    assert kernel_store.lines_for(tmp_path / "db", llvm_target)[1] == []
    with dbs.open_readonly(db_dir, json.loads((db_dir / dbs.KEY_FILE).read_text())) as d:
        assert not d.get_all_tuning_records()
    # a faster record (a later run's) is applied, and timed on the next check
    state = kernel_check.read(db_dir)
    state["default_faster"][0]["record_secs"] = secs[0] * (1 + 1e-9)  # as if timed when the best was slower
    (db_dir / kernel_check.CHECKS).write_text(json.dumps(state))
    assert len(dbs._best_lines(db_dir, 1, slower_than_default=True)[1]) == 1


def test_untuned_kernels_are_timed_once_and_the_slowest_is_tuned_first(tmp_path, llvm_target, tiny_opt, monkeypatch):
    from deploy.tuning import check as kernel_check
    from deploy.tuning import lanes as tune_lanes

    _, opt = tiny_opt
    tasks = tune_tasks.extract_tasks(opt.load_module(1), llvm_target.tvm_target())
    plan = [{"name": t.task_name, "mod": t.dispatched[0], "weight": float(t.weight), "flops": tune_tasks.task_flops(t),
             "left": 4, "done": 0} for t in tasks]
    times = kernel_check.time_defaults(tmp_path / "db", plan, llvm_target)
    assert set(times) == {p["name"] for p in plan} and all(v > 0 for v in times.values())
    state = json.loads((tmp_path / "db" / "database_checks.json").read_text())
    assert sorted(state["default_us"].values()) == sorted(times.values())
    # built in parallel processes where there are many: the same kernels timed
    monkeypatch.setattr(kernel_check, "PARALLEL_FROM", 1)
    assert set(kernel_check.time_defaults(tmp_path / "db2", plan, llvm_target)) == set(times)
    # kept with the database: not built or timed again
    monkeypatch.setattr(kernel_check, "_default_lib", lambda *a: pytest.fail("timed again"))
    assert kernel_check.time_defaults(tmp_path / "db", plan, llvm_target) == times
    # a kernel whose default does not build is remembered as such, not built on every run
    monkeypatch.setattr(kernel_check, "PARALLEL_FROM", 100)
    monkeypatch.setattr(kernel_check, "_default_lib", lambda *a: (None, False, None))
    assert kernel_check.time_defaults(tmp_path / "db3", plan, llvm_target) == {}
    assert set(json.loads((tmp_path / "db3" / "database_checks.json").read_text())["default_us"].values()) == {None}
    monkeypatch.setattr(kernel_check, "_default_lib", lambda *a: pytest.fail("built again"))
    assert kernel_check.time_defaults(tmp_path / "db3", plan, llvm_target) == {}

    for p in plan:
        p["default_us"] = times[p["name"]]
    slowest = max(plan, key=lambda p: p["default_us"] * p["weight"])
    assert sorted(plan, key=tune_tasks.order)[0] is slowest
    heavy = {"name": "untimed", "left": 4, "flops": 1e15, "weight": 1.0, "default_us": None}
    half_done = {"name": "half", "left": 2, "flops": 1.0, "weight": 1.0, "default_us": 1e9}
    ranked = sorted([half_done, heavy, *plan], key=tune_tasks.order)
    assert ranked[-2:] == [heavy, half_done]  # FLOPs only where untimed; most trials left first
    assert tune_lanes.split_tasks(plan, 1) == [sorted(plan, key=tune_tasks.order)]  # a lane tunes in that order
    # MAX_TASKS keeps the slowest per run, not the heaviest in FLOPs (times made to reverse the FLOPs order)
    profile = make_config(max_tasks=1).llvm
    by_flops = sorted(plan, key=lambda p: p["flops"] * p["weight"])
    reversed_times = {p["name"]: float(k + 1) / p["weight"] for k, p in enumerate(reversed(by_flops))}
    (kept,), _ = tune._plan(tasks, tmp_path / "db", profile, reversed_times)
    assert kept["name"] == by_flops[0]["name"]  # the lightest in FLOPs, the slowest here
    (heaviest,), _ = tune._plan(tasks, tmp_path / "db", profile)
    assert heaviest["name"] == by_flops[-1]["name"] != by_flops[0]["name"]


def test_a_done_run_reports_the_tasks_max_tasks_chose_by_time(tmp_path, llvm_target, tiny_opt, monkeypatch):
    """With MAX_TASKS, a run whose chosen tasks are done plans from the
    default times the database keeps, not by FLOPs: it times nothing, tunes
    nothing and reports the tasks it tuned. (Under load the timed order and
    the FLOPs order can differ, and a done run reported an untuned task.)"""
    from deploy import artifacts
    from deploy.tuning import check as kernel_check
    from deploy.tuning.store import workload_hashes

    exported, opt = tiny_opt
    tasks = tune_tasks.extract_tasks(opt.load_module(1), llvm_target.tvm_target())
    by_flops = sorted(tasks, key=lambda t: tune_tasks.task_flops(t) * t.weight)
    slow = {t.task_name: (k + 1) * 1e3 / t.weight for k, t in enumerate(reversed(by_flops))}  # the lightest: slowest

    def time_defaults(folder, plan, target):
        state = kernel_check.read(folder, target.kind)
        state["default_us"] = {next(iter(workload_hashes([t.dispatched[0]]))): slow[t.task_name] for t in tasks}
        folder.mkdir(parents=True, exist_ok=True)
        artifacts.write_json_atomic(folder / kernel_check.CHECKS, state)
        return {p["name"]: slow[p["name"]] for p in plan}

    monkeypatch.setattr(kernel_check, "time_defaults", time_defaults)
    cfg = make_config(trials=2, trials_per_task=2, trials_per_iter=2, max_tasks=1)
    s1, _ = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t1")
    assert list(s1["tasks"]) == [by_flops[0].task_name] != [by_flops[-1].task_name] and s1["trials_after"] == 2
    monkeypatch.setattr(kernel_check, "time_defaults", lambda *a: pytest.fail("timed again"))
    s2, _ = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t2")
    assert list(s2["tasks"]) == list(s1["tasks"]) and s2["new_trials"] == 0 and s2["trials_after"] == 2
    # a cache that misses a task (a change of the chain dropped its time) chooses nothing: every task is timed again
    db_dir = next((tmp_path / "db").glob("**/database_checks.json")).parent
    task_mods = [{"name": t.task_name, "mod": t.dispatched[0]} for t in tasks]
    assert set(kernel_check.cached_default_us(db_dir, task_mods, "llvm")) == set(slow)
    state = kernel_check.read(db_dir, "llvm")
    state["default_us"].pop(next(iter(state["default_us"])))
    artifacts.write_json_atomic(db_dir / kernel_check.CHECKS, state)
    assert kernel_check.cached_default_us(db_dir, task_mods, "llvm") is None


def test_checks_made_under_another_default_chain_are_timed_again(tmp_path, monkeypatch):
    """check.read: where the default chain changed before or at the source
    that made a workload's default schedule, that workload's timings are
    dropped (which records were timed, which a default beat, the default's
    time), so the next check times it against the new default; the others
    stay, and verdicts on outputs always stay. The kind comes from the caller
    or the folder's key.json; without either nothing is dropped or stamped.
    States from before rules had versions: CUDA 4 is the chain with every rule at 1, older
    CUDA numbers drop every timing."""
    from deploy.passes import schedule
    from deploy.tuning import check as kernel_check

    today = schedule.default_chain("cuda")
    assert today[-2:] == ["dlight.Fallback", "default"] and "dlight.Matmul" in today
    state = {"passed": ["a", "b"], "rejected": [{"record": "x"}], "chain": today,
             "timed": {"a": "w_mm", "b": "w_fb", "c": None},
             "default_rule": {"w_mm": "dlight.Matmul", "w_fb": "dlight.Fallback", "w_sr": "short-reduction"},
             "default_us": {"w_mm": 3.0, "w_fb": 4.0, "w_sr": 5.0},
             "default_faster": [{"record": "a", "workload": "w_mm", "record_secs": 1.0},
                                {"record": "b", "workload": "w_fb", "record_secs": 1.0}]}

    def read(folder_state, kind="cuda", key=True):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        if key:
            (folder / "key.json").write_text(json.dumps({"target": {"kind": kind}}))
        (folder / kernel_check.CHECKS).write_text(json.dumps(folder_state))
        return kernel_check.read(folder)

    assert read(state) == state  # made under today's chain: kept as it is
    # a new rule just before Fallback: only the workload Fallback scheduled is timed again
    v = schedule.RULE_VERSIONS
    monkeypatch.setattr(schedule, "RULE_VERSIONS", {**v, schedule.VECTOR_ROWS: v[schedule.VECTOR_ROWS] + 1})
    got = read(state)
    assert got["timed"] == {"a": "w_mm"} and got["default_rule"] == {"w_mm": "dlight.Matmul", "w_sr": "short-reduction"}
    assert got["default_us"] == {"w_mm": 3.0, "w_sr": 5.0} and [e["workload"] for e in got["default_faster"]] == ["w_mm"]
    assert got["passed"] == ["a", "b"] and got["rejected"] == state["rejected"] and got["chain"] != today
    # a change of a workload's own rule: that workload and those after it; the ones before keep theirs
    monkeypatch.setattr(schedule, "RULE_VERSIONS", {**v, schedule.SHORT_REDUCTION: v[schedule.SHORT_REDUCTION] + 1})
    got = read(state)
    assert got["timed"] == {"a": "w_mm"} and set(got["default_rule"]) == {"w_mm"} and set(got["default_us"]) == {"w_mm"}
    monkeypatch.undo()
    # a rule the chain no longer has: dropped
    got = read({**state, "chain": [*today[:-1], "gone@1", "default"], "default_rule": {"w_mm": "gone"}})
    assert got["timed"] == {} and got["default_rule"] == {}
    # a change of the first rule: every workload after it too
    monkeypatch.setattr(schedule, "RULE_VERSIONS", {**v, schedule.FEW_OUTPUTS: v[schedule.FEW_OUTPUTS] + 1})
    got = read(state)
    assert got["timed"] == {} and got["default_faster"] == [] and got["default_us"] == {}
    monkeypatch.undo()
    # before rules had versions: CUDA 4 is the chain of then with every rule at 1 (short-rows, mma-gemm and the
    # movement rules came later, and broadcast-epilogue came after the reductions then; its timings name no workload and no
    # rule, so the next change of the chain drops them all, as short-reduction@2 did); CUDA 3 and older are
    # dropped now; another kind is its own
    legacy = {"passed": ["a"], "rejected": [], "timed": ["a"], "defaults": 4, "default_us": {"w": 3.0},
              "default_faster": [{"record": "a", "workload": "w", "record_secs": 1.0}]}
    monkeypatch.setattr(schedule, "RULE_VERSIONS", dict.fromkeys(v, 1))
    monkeypatch.setitem(schedule.CHAINS, "cuda", [schedule.FEW_OUTPUTS, "dlight.Matmul", "dlight.GEMV",
                                                  schedule.SHORT_REDUCTION, "dlight.Reduction",
                                                  "dlight.GeneralReduction", schedule.BROADCAST_EPILOGUE,
                                                  "dlight.Fallback"])
    got = read(legacy)
    assert got["timed"] == {"a": None} and got["default_us"] == {"w": 3.0} and got["chain"] == schedule.default_chain(
        "cuda")
    assert "defaults" not in got
    monkeypatch.undo()
    got = read(legacy)
    assert (got["timed"], got["default_us"], got["passed"], got["chain"]) == ({}, {}, ["a"], today)
    got = read({**legacy, "defaults": 3})
    assert got["timed"] == {} and got["default_faster"] == [] and got["default_us"] == {} and got["passed"] == ["a"]
    assert read({**legacy, "defaults": 1}, kind="llvm")["timed"] == {}  # llvm 1: a chain of then, changed since
    monkeypatch.setattr(schedule, "RULE_VERSIONS", dict.fromkeys(v, 1))
    monkeypatch.setitem(schedule.CHAINS, "llvm", [schedule.CONTRACTION, "dlight.Reduction", schedule.INJECTIVE])
    assert read({**legacy, "defaults": 1}, kind="llvm")["timed"] == {"a": None}  # ... kept under that chain
    monkeypatch.undo()
    nokey = read({**legacy, "defaults": 3}, key=False)
    assert nokey["timed"] == {"a": None} and "chain" not in nokey
    last = max(tmp_path.iterdir(), key=lambda f: int(f.name))  # (the folder without key.json)
    assert kernel_check.read(last, "cuda")["timed"] == {}  # the caller's kind


def test_a_check_names_the_rule_of_each_default_it_timed(tmp_path, llvm_target, tiny_opt):
    """The check and time_defaults record which source of the chain made
    each workload's default schedule: what check.read needs to keep a
    timing when a rule is added or changed elsewhere in the chain."""
    from deploy.passes import schedule
    from deploy.tuning import check as kernel_check

    db_dir = _two_records_unchecked(tmp_path, llvm_target, tiny_opt)
    kernel_check.check_database(db_dir, llvm_target)
    state = kernel_check.read(db_dir)
    names = {c.split("@")[0] for c in schedule.default_chain("llvm")}
    assert len(state["timed"]) == 2 and set(state["timed"].values()) <= set(state["default_rule"])
    assert set(state["default_rule"].values()) <= names and state["chain"] == schedule.default_chain("llvm")


def test_the_lanes_merge_every_per_task_list_of_the_summary():
    """Which tasks got our design spaces (or only ours) reaches the merged
    summary of a run in lanes, as the tasks without tensor cores do; empty
    lists are left out."""
    from deploy.tuning import lanes

    def lane(n, **lists):
        return {"lane": n, "stats": {}, "seconds": 1.0, "summary": lists}

    summary: dict = {}
    lanes._combine_lanes([lane(0, own_spaces={"a": "short-reduction"}, without_tensor_cores={"b": "why"}),
                          lane(1, own_spaces={"c": "short-reduction"})], summary, {}, 2)
    assert summary["own_spaces"] == {"a": "short-reduction", "c": "short-reduction"}
    assert summary["without_tensor_cores"] == {"b": "why"}
    assert "own_spaces_only" not in summary and "unschedulable" not in summary


def test_a_budget_spent_on_timing_the_defaults_starts_no_search(tmp_path, llvm_target, tiny_opt, monkeypatch, caplog):
    """The first run of a database times every kernel's default schedule
    once; where that leaves less than MIN_SEARCH_S of the budget, no search
    starts (two lanes on the H200 started for 7 s and tuned nothing) and the
    summary says why."""
    import time as time_mod

    from deploy.tuning import check as kernel_check

    exported, opt = tiny_opt
    cfg = make_config(trials=64, trials_per_task=32, trials_per_iter=2)

    def slow_defaults(folder, tasks, target):
        time_mod.sleep(1.0)
        return {}

    monkeypatch.setattr(kernel_check, "time_defaults", slow_defaults)
    monkeypatch.setattr(tune, "MIN_SEARCH_S", 60.0)
    with caplog.at_level("WARNING"):
        s, _ = _tune(cfg, llvm_target, exported, opt, tmp_path / "db", tmp_path / "t", budget_s=20.0)
    assert s["new_trials"] == 0 and s["budget_spent_timing_defaults_s"] >= 1.0
    assert any("the budget is spent" in r.getMessage() for r in caplog.records)


def test_drop_rejected_ids_only_the_workloads_with_a_rejection(tmp_path, monkeypatch):
    """check.drop_rejected computes a record's id (costly) only for workloads
    with a rejected record; a rejection written without its workload (older
    checks) still drops its record from any workload."""
    from deploy.tuning import check as kernel_check

    workloads = [json.dumps(["w0", {}]), json.dumps(["w1", {}])]
    recs = [[["trace", i], [1e-5 * (i + 1)], {}, [["TENSOR", "float32", [i]]]] for i in range(4)]
    lines = [json.dumps([i % 2, r]) for i, r in enumerate(recs)]
    ids = [kernel_check.record_id(f"w{i % 2}", r) for i, r in enumerate(recs)]
    seen = []
    real = kernel_check.record_id
    monkeypatch.setattr(kernel_check, "record_id", lambda shash, rec: seen.append(shash) or real(shash, rec))
    state = {"passed": [], "rejected": [{"record": ids[1], "workload": "w1"}], "timed": {}, "default_rule": {},
             "default_faster": []}
    (tmp_path / kernel_check.CHECKS).write_text(json.dumps(state))
    assert kernel_check.drop_rejected(tmp_path, workloads, lines) == [lines[0], lines[2], lines[3]]
    assert set(seen) == {"w1"}
    state["rejected"] = [{"record": ids[2]}]  # no workload named
    (tmp_path / kernel_check.CHECKS).write_text(json.dumps(state))
    assert kernel_check.drop_rejected(tmp_path, workloads, lines) == [lines[0], lines[1], lines[3]]


def test_a_database_tuned_for_other_kernels_is_called_stale():
    from deploy.build import stale_database

    def info(have, other, kernels=25):
        return {"kernels": kernels, "database": {"path": "db/fp16-nhwc-b1", "kernels_with_records": have,
                                                 "records_of_other_kernels": other}}

    text = stale_database(info(1, 30))  # ConvNeXt-T b1 on 2026-12-04: 1 of 25, its other records from 45 kernels
    assert text.startswith("its database has tuned records of 1 of the module's 25 kernels and of 30 kernels")
    assert "db/fp16-nhwc-b1" in text
    assert stale_database(info(13, 30)) is None  # half the kernels tuned: not stale, whatever else it holds
    assert stale_database(info(3, 3)) is None  # few records either way: a database barely tuned
    # a database barely tuned, with a few records gone stale, is left alone
    assert stale_database(info(2, 3, kernels=63)) is None and stale_database(info(2, 16, kernels=63)) is not None
    assert stale_database(info(0, 0)) is None and stale_database({"kernels": 5, "database": None}) is None
    # the run's summary line says it too
    from deploy import pipeline

    bucket = {**info(1, 30), "tuned_kernels": 1}
    assert "its database tuned for other kernels (tune it again)" in pipeline.format_summary(
        {"package": "p", "buckets": {"1": bucket}, "validation": None})
    assert "tuned for other kernels" not in pipeline.format_summary(
        {"package": "p", "buckets": {"1": {**info(20, 30), "tuned_kernels": 20}}, "validation": None})


def test_the_kernel_check_keeps_ids_inside_the_table_they_index():
    """The check seeds integer arguments in [0, 10); one that indexes a
    table (a gather: TVM's `take` does not check it) stays below the
    table's rows: a 2-row token-type table beside a word embedding."""
    import numpy as np

    from deploy.tuning import check
    from deploy.tvm_compat import relax, tirx

    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((1, 16), "int64"))
    types = relax.Var("types", relax.TensorType((1, 16), "int64"))
    with bb.function("main", [ids, types]):
        with bb.dataflow():
            words = relax.const(np.zeros((100, 8), "float16"))
            kinds = relax.const(np.zeros((2, 8), "float16"))
            out = bb.emit_output(relax.op.add(relax.op.take(words, ids, axis=0), relax.op.take(kinds, types, axis=0)))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    kernels = {next(b.name for b in f.params if b.name in ("ids", "types")): f for f in mod.functions.values()
               if isinstance(f, tirx.PrimFunc) and {"ids", "types"} & {b.name for b in f.params}}
    for name, rows in (("ids", 100), ("types", 2)):
        func = kernels[name]
        k = [b.name for b in func.params].index(name)
        bounds = check.index_bounds(func)
        assert bounds == {k: rows}
        args = check._seeded_args(check._buffers(func), bounds)
        assert args[k].min() >= 0 and args[k].max() < min(rows, 10) and len(set(args[k].ravel())) > 1
    add = next(f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc) and "T_add" in
               {b.name for b in f.params})
    assert check.index_bounds(add) == {}
    assert check._seeded_args(check._buffers(kernels["types"]))[k].max() >= 2  # what the check fed it before
