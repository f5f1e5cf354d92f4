"""Tuning-database storage: compressed committed files, working copy, union merge (no TVM needed)."""

import json
import lzma

import pytest

from deploy.errors import DatabaseMismatchError, StaleArtifactError
from deploy.tuning import database as dbs


def _lines(*items):
    return [json.dumps(x, separators=(",", ":")) for x in items]


def test_merge_keeps_base_order_and_reindexes_extra():
    base = (_lines(["h1", "A"], ["h2", "B"]), _lines([0, ["t1", [1.0]]], [1, ["t2", [2.0]]]))
    # the same workload B at another index, one duplicate record, one new workload
    extra = (_lines(["h2", "B"], ["h3", "C"]), _lines([0, ["t2", [2.0]]], [0, ["t3", [3.0]]], [1, ["t4", [4.0]]]))
    w, r, added = dbs.merge(base, extra)
    assert added == 2
    assert w[:2] == base[0] and json.loads(w[2]) == ["h3", "C"]
    assert r[:2] == base[1]
    assert [json.loads(x) for x in r[2:]] == [[1, ["t3", [3.0]]], [2, ["t4", [4.0]]]]
    # merging again adds nothing
    assert dbs.merge((w, r), extra)[2] == 0


def _working_copy(folder, workloads, records, torn=False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / dbs.WORKLOADS).write_text("".join(x + "\n" for x in workloads))
    (folder / dbs.RECORDS).write_text("".join(x + "\n" for x in records) + ('[0, ["torn' if torn else ""))


def test_pack_folds_working_copy_and_survives_a_torn_line(tmp_path):
    d = tmp_path / "db"
    _working_copy(d, _lines(["h1", "A"]), _lines([0, ["t1", [1.0]]], [0, ["t2", [2.0]]]), torn=True)
    assert dbs.has_records(d)
    assert dbs.pack(d) == 2
    assert not (d / dbs.RECORDS).exists() and not (d / dbs.WORKLOADS).exists()
    assert len(dbs._packed_lines(d / (dbs.RECORDS + dbs.PACKED))) == 2
    first = dbs.digest(d)
    # a second working copy (say, a later run that was killed) adds to it
    _working_copy(d, _lines(["h1", "A"]), _lines([0, ["t2", [2.0]]], [0, ["t3", [3.0]]]))
    assert dbs.pack(d) == 1
    assert len(dbs._packed_lines(d / (dbs.RECORDS + dbs.PACKED))) == 3
    assert dbs.digest(d) != first
    # nothing to pack: nothing changes
    assert dbs.pack(d) == 0
    # deterministic compression: the same content gives the same digest
    d2 = tmp_path / "db2"
    _working_copy(d2, _lines(["h1", "A"]), _lines([0, ["t1", [1.0]]], [0, ["t2", [2.0]]], [0, ["t3", [3.0]]]))
    dbs.pack(d2)
    assert (d2 / (dbs.RECORDS + dbs.PACKED)).read_bytes() == (d / (dbs.RECORDS + dbs.PACKED)).read_bytes()


def test_compression_is_large_on_repetitive_records(tmp_path):
    d = tmp_path / "db"
    trace = [["Split", ["l1", [None, 16, 4]], ["l2", "l3"]]] * 200
    _working_copy(d, _lines(["h1", "A"]), _lines(*[[0, [trace, [i * 1e-6]]] for i in range(200)]))
    plain = (d / dbs.RECORDS).stat().st_size
    dbs.pack(d)
    assert (d / (dbs.RECORDS + dbs.PACKED)).stat().st_size * 50 < plain


def test_corrupt_packed_file_is_a_clear_error(tmp_path):
    d = tmp_path / "db"
    d.mkdir()
    (d / (dbs.RECORDS + dbs.PACKED)).write_bytes(b"not xz")
    (d / (dbs.WORKLOADS + dbs.PACKED)).write_bytes(lzma.compress(b""))
    _working_copy(d, _lines(["h1", "A"]), _lines([0, ["t1", [1.0]]]))
    with pytest.raises(StaleArtifactError, match="is corrupt"):
        dbs.pack(d)
    # the working copy is kept, not lost with the failed pack
    assert (d / dbs.RECORDS).is_file()


def test_pack_databases_command(tmp_path, capsys):
    from deploy.cli import main

    d = tmp_path / "root" / "m" / "t" / "fp16-nhwc-b1"
    _working_copy(d, _lines(["h1", "A"]), _lines([0, ["t1", [1.0]]]))
    (d / dbs.KEY_FILE).write_text("{}")
    assert main(["pack-databases", str(tmp_path / "root")]) == 0
    assert "1 record(s) folded in" in capsys.readouterr().out
    assert not (d / dbs.RECORDS).exists() and (d / (dbs.RECORDS + dbs.PACKED)).is_file()
    assert main(["pack-databases", str(tmp_path / "missing")]) == 2


def test_best_records_per_workload_for_builds_and_search_seeds():
    recs = _lines(
        [0, ["a", [3.0]]], [1, ["b", [1.0]]], [0, ["c", [1e10]]],  # 1e10: a failed candidate
        [0, ["d", [1.0, 2.0]]], [1, ["e", [0.5]]], [0, ["f", [2.0]]],
    )
    best1 = [json.loads(x)[1][0] for x in dbs._best_per_workload(recs, 1)]
    assert best1 == ["d", "e"]  # d: mean 1.5 beats f (2.0) and a (3.0); kept in file order
    best2 = [json.loads(x)[1][0] for x in dbs._best_per_workload(recs, 2)]
    assert best2 == ["b", "d", "e", "f"]
    assert len(dbs._best_per_workload(recs, 10)) == 6  # the failed one too, ranked last


def test_lane_databases_are_folded_in_by_pack(tmp_path):
    """A tuning lane's database (beside its own, as a killed run leaves it) is
    folded in by the next pack: a union, a torn line dropped, the lane folder
    removed; one made for another key is refused and left in place."""
    key = {"model": "m", "target": "t"}
    a = tmp_path / "m" / "db"
    b = dbs.lane_dir(a, 0)
    wl = ['["h1",{}]', '["h2",{}]']
    def rec(w, t):
        return json.dumps([w, [{"trace": t}, [1e-5], {}, []]])

    a.mkdir(parents=True)
    (a / dbs.KEY_FILE).write_text(json.dumps(key))
    (a / dbs.WORKLOADS).write_text(wl[0] + "\n")
    (a / dbs.RECORDS).write_text(rec(0, "x") + "\n")
    dbs.pack(a)
    # b: packed records (one shared with a), plus a working copy the killed lane left
    b.mkdir()
    (b / dbs.KEY_FILE).write_text(json.dumps(key))
    (b / dbs.WORKLOADS).write_text(wl[1] + "\n" + wl[0] + "\n")
    (b / dbs.RECORDS).write_text(rec(0, "y") + "\n" + rec(1, "x") + "\n")
    dbs.pack(b)
    (b / dbs.WORKLOADS).write_text(wl[1] + "\n")
    (b / dbs.RECORDS).write_text(rec(0, "z") + "\n" + '[0, [{"trace": "torn')
    assert dbs.lane_dirs(a) == [b] and dbs.lane_owner(b) == a and dbs.lane_owner(a) is None
    assert dbs.has_records(a)
    assert dbs.pack(a) == 2  # y and z; x is already there; the torn line is dropped
    assert not b.exists()
    workloads, records = dbs._all_lines(a)
    got = sorted((json.loads(workloads[json.loads(r)[0]])[0], json.loads(r)[1][0]["trace"]) for r in records)
    assert got == [("h1", "x"), ("h2", "y"), ("h2", "z")]
    c = dbs.lane_dir(a, 1)
    c.mkdir()
    (c / dbs.KEY_FILE).write_text(json.dumps({**key, "target": "other"}))
    (c / dbs.WORKLOADS).write_text(wl[0] + "\n")
    (c / dbs.RECORDS).write_text(rec(0, "w") + "\n")
    with pytest.raises(DatabaseMismatchError, match="made for another target"):
        dbs.pack(a)
    assert c.exists()


def test_pack_databases_folds_a_lane_whose_database_is_new(tmp_path, capsys):
    """A run killed on a new database leaves only its lanes' folders:
    `pack-databases` makes the database from them."""
    from deploy import cli

    a = tmp_path / "root" / "m" / "db"
    b = dbs.lane_dir(a, 0)
    b.mkdir(parents=True)
    (b / dbs.KEY_FILE).write_text(json.dumps({"model": "m"}))
    (b / dbs.WORKLOADS).write_text('["h1",{}]\n')
    (b / dbs.RECORDS).write_text(json.dumps([0, [{"trace": "x"}, [1e-5], {}, []]]) + "\n")
    assert cli.main(["pack-databases", str(tmp_path / "root")]) == 0
    assert f"{a}: 1 record(s) folded in" in capsys.readouterr().out
    assert not b.exists() and len(dbs._packed_lines(a / (dbs.RECORDS + dbs.PACKED))) == 1


def _journal(folder, *items, torn=False):
    from deploy.tuning import journal

    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in items)
    (folder / journal.MEASURED).write_text(text + ('{"w":"h1","record":[["cut' if torn else ""))


def test_pack_folds_the_journal_of_a_killed_run(tmp_path):
    """A run killed outright leaves candidates in its journal that
    MetaSchedule never saved: pack adds each once (a candidate MetaSchedule
    saved too is matched by workload, trace and arguments, not by its times
    or the target's key order), a new workload with it; a torn last line
    and a record whose workload line was lost are dropped."""
    from deploy.tuning import journal

    d = tmp_path / "db"
    target = {"kind": "llvm", "keys": ["cpu"]}
    _working_copy(d, _lines(["h1", "A"]), _lines([0, ["t1", [1.0], {"keys": ["cpu"], "kind": "llvm"}, ["a"]]]))
    _journal(
        d,
        {"workload": ["h1", "A"]},
        {"w": "h1", "record": ["t1", [1.0000001], target, ["a"]]},  # saved by MetaSchedule too
        {"w": "h1", "record": ["t2", [2.0], target, ["a"]]},
        {"workload": ["h2", "B"]},
        {"w": "h2", "record": ["t3", [1e10], target, ["b"]]},  # a failed candidate is a record too
        {"w": "h9", "record": ["t4", [3.0], target, ["c"]]},  # its workload line never written
        torn=True,
    )
    assert dbs.has_records(d)
    _, r = dbs._all_lines(d)  # what trials_done counts, before any pack
    assert len(r) == 3
    assert dbs.pack(d) == 3
    assert not (d / journal.MEASURED).exists()
    w = [json.loads(x) for x in dbs._packed_lines(d / (dbs.WORKLOADS + dbs.PACKED))]
    r = [json.loads(x) for x in dbs._packed_lines(d / (dbs.RECORDS + dbs.PACKED))]
    assert w == [["h1", "A"], ["h2", "B"]]
    assert [(wi, rec[0]) for wi, rec in r] == [(0, "t1"), (0, "t2"), (1, "t3")]
    # the same journal again (a second kill before any pack) adds nothing
    _journal(d, {"workload": ["h1", "A"]}, {"w": "h1", "record": ["t2", [2.5], target, ["a"]]})
    assert dbs.pack(d) == 0


def test_a_candidate_is_one_candidate_however_its_trace_is_written():
    """TVM's Python API writes a tensorized trace's layout maps as indented
    JSON and some of its booleans as true; its JSON database writes the same
    candidate compactly and with 1 (seen on the H200: 572 of a vit chunk's
    865 candidates were kept twice). The journal's identity sees one."""
    from deploy.tuning import journal

    layout = {"root_index": 2, "nodes": [{"type": "None"}, {"type": "ir.Var", "data": {"name": 1}}]}
    python_api = [[["TransformLayout", ["b0", json.dumps(layout, indent=2)], [0, 0, None, True], []]], [[4, [1, 2]]]]
    database = [[["TransformLayout", ["b0", json.dumps(layout, separators=(",", ":"))], [0, 0, None, 1], []]],
                [[4, [1, 2]]]]
    args = [["TENSOR", "float16", [1, 8]]]
    assert journal.identity("h", [python_api, [1.0], {}, args]) == journal.identity("h", [database, [2.0], {}, args])
    other = [[["TransformLayout", ["b0", json.dumps(layout)], [0, 0, None, 0], []]], [[4, [2, 1]]]]
    assert journal.identity("h", [other, [1.0], {}, args]) != journal.identity("h", [database, [1.0], {}, args])
    # the journal stores the compact form, as the database does
    assert journal.canonical(python_api)[0][0][1][1] == database[0][0][1][1]


def test_the_journal_never_stops_the_tuning_it_guards(tmp_path):
    """A trace the journal cannot read, a batch it was not offered, a write
    after it was closed: each is a warning, never an error in the search,
    the builder or the runner."""
    import types

    from deploy.tuning import journal

    j = journal.Journal(tmp_path)
    broken = types.SimpleNamespace(sch=types.SimpleNamespace(trace=None), args_info=[])  # .as_json fails
    j.offer({"shash": "h", "workload": ["h", "A"], "target": {}}, [broken])
    ok = types.SimpleNamespace(error_msg=None, artifact_path="/a.so")
    j.built([ok])  # nothing offered: nothing paired
    j.measured("/a.so", types.SimpleNamespace(error_msg=None, run_secs=[1.0]))
    j.offer(None, [broken])  # a task whose workload could not be read
    entry = {"task": {"shash": "h", "workload": ["h", "A"], "target": {}}, "trace": [], "args": []}
    j._pending = [entry]
    j.built([ok])
    j.close()
    j.measured("/a.so", types.SimpleNamespace(error_msg=None, run_secs=[1.0]))  # after close
    assert j.failed and j.records == 0
    assert journal.read(tmp_path / journal.MEASURED) == ({}, [])


def test_the_journal_counts_each_candidate_and_knows_how_long_the_built_ones_take(tmp_path, monkeypatch):
    """`on_record` once per candidate written (a failed build at once, the
    rest as each is measured: the progress bar); `backlog_seconds`: the
    candidates built and not measured, at the rate of the last results (None
    before RATE_MIN of them, 0 with none waiting)."""
    import types

    from deploy.tuning import journal

    now = [100.0]
    monkeypatch.setattr(journal.time, "monotonic", lambda: now[0])
    j = journal.Journal(tmp_path)
    counted = []
    j.on_record = lambda: counted.append(1)
    task = {"shash": "h", "workload": ["h", "A"], "target": {}}
    n = journal.RATE_MIN + 4
    j._pending = [{"task": task, "trace": [i], "args": []} for i in range(n + 1)]
    built = [types.SimpleNamespace(error_msg=None, artifact_path=f"/{i}.so") for i in range(n)]
    j.built([*built, types.SimpleNamespace(error_msg="nvcc failed", artifact_path="")])
    assert len(counted) == 1 and j.backlog_seconds() is None  # the failed build; nothing measured yet
    ok = types.SimpleNamespace(error_msg=None, run_secs=[1e-5])
    for i in range(journal.RATE_MIN + 1):  # one result every 0.5 s, others waiting
        j.measured(f"/{i}.so", ok)
        now[0] += 0.5
    assert len(counted) == 2 + journal.RATE_MIN
    assert j.backlog_seconds() == pytest.approx(3 * 0.5)  # 3 waiting
    for i in range(journal.RATE_MIN + 1, n):
        j.measured(f"/{i}.so", ok)
        now[0] += 0.5
    assert j.backlog_seconds() == 0.0 and len(counted) == n + 1 == j.records
    # an idle gap (nothing waited) is not the rate; a cancelled measurement no longer waits
    j._pending = [{"task": task, "trace": ["y", i], "args": []} for i in range(2)]
    j.built([types.SimpleNamespace(error_msg=None, artifact_path=f"/y{i}.so") for i in range(2)])
    now[0] += 1000.0
    assert j.backlog_seconds() == pytest.approx(2 * 0.5)
    j.measured_future("/y0.so", types.SimpleNamespace(cancelled=lambda: True))
    assert j.backlog_seconds() == pytest.approx(0.5)
    # a task the journal cannot read is not journaled, and still counted
    before = len(counted)
    j.offer(None, [object(), object()])
    j.built([types.SimpleNamespace(error_msg="failed", artifact_path=""),
             types.SimpleNamespace(error_msg=None, artifact_path="/z.so")])
    j.measured("/z.so", ok)
    assert len(counted) == before + 2 and j.records == n + 1
    j.on_record = lambda: 1 / 0  # a callback that raises changes nothing
    j._pending = [{"task": task, "trace": ["x"], "args": []}]
    j.built([types.SimpleNamespace(error_msg="failed", artifact_path="")])
    assert j.records == n + 2
    j.close()
