"""MetaSchedule files a record under the first structurally equal workload
of its database (names ignored), while the record's trace finds blocks by
names: a kernel tuned under new buffer names made a database that TVM could
no longer load (ViT-S/16 b32 on the H200, 2026-12-04). tasks.stored_module
tunes the stored module instead; database._json_database leaves out records
that do not replay, so that one bad record does not fail a whole build."""

from __future__ import annotations

import json
import logging

import pytest

from deploy.tuning import database as dbs
from deploy.tuning import tasks
from deploy.tvm_compat import ms, s_tir, tvm


def _matmul(a_name: str, b_name: str):
    from tvm import te

    a = te.placeholder((64, 32), "float32", name=a_name)
    b = te.placeholder((32, 48), "float32", name=b_name)
    r = te.reduce_axis((0, 32), "r")
    c = te.compute((64, 48), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="matmul")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")})


def _record(db, mod, workload):
    """A record whose trace was made on `mod` (a cache stage named after its
    first input), filed under `workload`."""
    sch = s_tir.Schedule(mod)
    sch.cache_read(sch.get_sblock("matmul"), 0, "shared")
    name = mod["main"].params[0].name  # the stage's name, as a postprocessor later finds it
    sch.get_sblock(f"{name}_shared")
    return ms.database.TuningRecord(sch.trace, workload, run_secs=[1e-3], target=tvm.target.Target("llvm"),
                                    args_info=ms.arg_info.ArgInfo.from_prim_func(mod["main"]))


def _db(path):
    return ms.database.JSONDatabase(path_workload=str(path / dbs.WORKLOADS),
                                    path_tuning_record=str(path / dbs.RECORDS), allow_missing=True)


def test_still_needed_a_renamed_kernels_record_breaks_the_database(tmp_path):
    """Fails once MetaSchedule files records by names too, or its traces
    stop naming blocks after buffers: then stored_module can go."""
    old, new = _matmul("lv10", "lv11"), _matmul("lv4", "lv5")
    db = _db(tmp_path)
    db.commit_workload(old)
    assert "lv10" in db.commit_workload(new).mod.script()  # the same workload, names aside
    db.commit_tuning_record(_record(db, new, db.commit_workload(new)))
    with pytest.raises(Exception):  # noqa: B017 - TVM's load raises a bare RuntimeError/ScheduleError
        _db(tmp_path)


def test_tuning_the_stored_module_keeps_the_database_loadable(tmp_path):
    old, new = _matmul("lv10", "lv11"), _matmul("lv4", "lv5")
    db = _db(tmp_path)
    db.commit_workload(old)
    mod = tasks.stored_module(db, new)
    assert "lv10" in mod.script() and "lv4" not in mod.script()
    db.commit_tuning_record(_record(db, mod, db.commit_workload(mod)))
    assert len(_db(tmp_path).get_all_tuning_records()) == 1
    (tmp_path / "other").mkdir()
    fresh = _db(tmp_path / "other")
    assert "lv4" in tasks.stored_module(fresh, new).script()  # a new workload is tuned as it is


def test_unreadable_records_are_left_out_not_the_database(tmp_path, caplog):
    old, new = _matmul("lv10", "lv11"), _matmul("lv4", "lv5")
    db = _db(tmp_path)
    workload = db.commit_workload(old)
    db.commit_tuning_record(_record(db, old, workload))
    db.commit_tuning_record(_record(db, new, workload))  # filed under the old names
    with caplog.at_level(logging.WARNING):
        loaded = dbs._json_database(tmp_path, tmp_path / "label")
    assert len(loaded.get_all_tuning_records()) == 1
    assert "1 record(s) do not replay" in caplog.text and "label" in caplog.text
    lines = (tmp_path / dbs.RECORDS).read_text().splitlines()
    assert len([ln for ln in lines if ln.strip()]) == 1
    assert json.loads(lines[0])[0] == 0
