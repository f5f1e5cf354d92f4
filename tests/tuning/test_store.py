"""The kernel store: the best record of each workload over every database of
one target, shared by every model (no TVM needed, but for the seeding test's
database object, which is stubbed)."""

import json

from deploy.targets import TargetInfo
from deploy.tuning import database as dbs
from deploy.tuning import store


def _lines(*items):
    return [json.dumps(x, separators=(",", ":")) for x in items]


H200 = TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H200", False)
H100 = TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H100", False)


def _database(root, model, target, workloads, records):
    folder = root / model / target.slug / "fp16-nhwc-b1"
    folder.mkdir(parents=True)
    (folder / dbs.KEY_FILE).write_text(json.dumps({"model": model, "target": target.key()}))
    dbs._write_packed(folder / (dbs.WORKLOADS + dbs.PACKED), _lines(*workloads))
    dbs._write_packed(folder / (dbs.RECORDS + dbs.PACKED), _lines(*records))
    return folder


def test_refresh_keeps_the_fastest_valid_record_of_each_workload_per_target(tmp_path):
    _database(tmp_path, "a", H200, [["h1", "A"], ["h2", "B"]],
              [[0, ["t1", [3.0]]], [0, ["t2", [1.0]]], [1, ["t3", [1e10]]]])  # h2 only failed
    _database(tmp_path, "b", H200, [["h3", "C"], ["h1", "A"]], [[0, ["t4", [2.0]]], [1, ["t5", [2.0]]]])
    _database(tmp_path, "c", H100, [["h1", "A"]], [[0, ["t6", [0.5]]]])  # another GPU: its own store
    out = store.refresh(tmp_path)
    assert out == {str(store.folder(tmp_path, H200)): 2, str(store.folder(tmp_path, H100)): 1}
    w, r = store.lines_for(tmp_path, H200)
    best = {json.loads(w[json.loads(ln)[0]])[0]: json.loads(ln)[1][0] for ln in r}
    assert best == {"h1": "t2", "h3": "t4"}  # the fastest of a's and b's; no failed record
    assert store.lines_for(tmp_path, H100)[1] and json.loads(store.lines_for(tmp_path, H100)[1][0])[1][0] == "t6"
    # only the kernels a module has
    w, r = store.lines_for(tmp_path, H200, {"h3", "h9"})
    assert [json.loads(x)[0] for x in w] == ["h3"] and [json.loads(x)[0] for x in r] == [0]
    assert dbs.hashes_of((w, r)) == {"h3"}
    # rebuilt, not appended to: a database removed takes its records out
    first = store.digest(tmp_path, H200)
    assert store.refresh(tmp_path) and store.digest(tmp_path, H200) == first  # deterministic
    import shutil

    shutil.rmtree(tmp_path / "b")
    store.refresh(tmp_path)
    assert dbs.hashes_of(store.lines_for(tmp_path, H200)) == {"h1"}


def test_a_store_for_another_target_is_not_used(tmp_path):
    _database(tmp_path, "a", H200, [["h1", "A"]], [[0, ["t1", [1.0]]]])
    store.refresh(tmp_path)
    other = TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda", "max_shared_memory_per_block": 1}', "sm_90",
                       "NVIDIA H200", False)
    assert other.slug == H200.slug  # the same folder, another target
    assert store.lines_for(tmp_path, other) == ([], [])


def test_seeded_records_guide_the_search_but_never_enter_the_database(tmp_path, monkeypatch):
    monkeypatch.setattr(dbs, "_json_database", lambda folder: None)
    d = tmp_path / "db"
    key = {"model": "m"}
    seeds = (_lines(["h1", "A"], ["h2", "B"]), _lines([0, ["s1", [1.0]]], [1, ["s2", [2.0]]]))
    # an own record for h1 already: the store's is seeded beside it
    _database(tmp_path, "own", H200, [["h1", "A"]], [[0, ["o1", [1.5]]]])
    own = tmp_path / "own" / H200.slug / "fp16-nhwc-b1"
    (d).mkdir()
    (d / dbs.KEY_FILE).write_text(json.dumps(key))
    for name in (dbs.WORKLOADS, dbs.RECORDS):
        (d / (name + dbs.PACKED)).write_bytes((own / (name + dbs.PACKED)).read_bytes())
    dbs.open_for_tuning(d, key, store=seeds)
    working = (d / dbs.RECORDS).read_text().splitlines()
    assert len(working) == 3 and (d / dbs.SEEDED).is_file()
    assert len(dbs._all_lines(d)[1]) == 1  # what trials_done counts: the own record only
    # a candidate measured during the run is appended by MetaSchedule
    with open(d / dbs.RECORDS, "a") as f:
        f.write(json.dumps([1, ["n1", [0.5]]], separators=(",", ":")) + "\n")
    assert dbs.pack(d) == 1
    assert not (d / dbs.SEEDED).exists()
    r = [json.loads(x)[1][0] for x in dbs._packed_lines(d / (dbs.RECORDS + dbs.PACKED))]
    assert r == ["o1", "n1"]


def test_the_build_stage_applies_the_kernel_store_as_run_does(monkeypatch, tmp_path):
    """`deploy build` (the stage alone) gives the build the databases' root,
    whose kernel store it applies, as `deploy run` does (it gave none)."""
    import types

    from deploy import build, cli, config, export, optimize, pipeline, targets

    seen = {}
    monkeypatch.setattr(cli, "_same_dims", lambda cfg, ws: None)
    monkeypatch.setattr(export, "load", lambda folder: types.SimpleNamespace(inputs=(), dims=()))
    monkeypatch.setattr(optimize, "load", lambda folder: "opt")
    monkeypatch.setattr(pipeline, "existing_databases", lambda *a, **k: ({}, {}))
    monkeypatch.setattr(build, "run", lambda *a, **k: seen.update(args=a, kwargs=k) or types.SimpleNamespace(
        folder=tmp_path / "pkg"))
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}})
    ws = types.SimpleNamespace(export=tmp_path / "e", optimize=tmp_path / "o", package=tmp_path / "pkg")
    args = types.SimpleNamespace(command="build")
    assert cli._run_stage(args, cfg, targets.resolve("llvm"), tmp_path, tmp_path / "db", cfg.llvm, ws) == 0
    assert tmp_path / "db" in (*seen["args"][8:], seen["kwargs"].get("store_root"))


def test_the_committed_stores_are_what_the_committed_databases_make(tmp_path):
    """A database committed without `pack-databases` (or the end of a tuning
    run) leaves its GPU's store behind it, and a build then misses the
    kernels only that database tuned (29 of ViT-S/16's and BERT's b32 ones
    until 2026-12-07). Rebuilt from a copy, every committed store must come
    out as it is."""
    import shutil
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "tuning_logs"
    if not (committed / store.STORE).is_dir():
        import pytest

        pytest.skip("no committed kernel store in this checkout")
    copy = tmp_path / "tuning_logs"
    working = shutil.ignore_patterns(dbs.WORKLOADS, dbs.RECORDS, dbs.SEEDED, "*.jsonl", ".lock")  # git-ignored
    shutil.copytree(committed, copy, ignore=working, copy_function=shutil.copyfile)
    rebuilt = store.refresh(copy)
    stores = sorted(p.name for p in (committed / store.STORE).iterdir() if p.is_dir())
    assert sorted(Path(p).name for p in rebuilt) == stores
    for name in stores:
        for part in (dbs.WORKLOADS, dbs.RECORDS):
            have = dbs._packed_lines(committed / store.STORE / name / (part + dbs.PACKED))
            want = dbs._packed_lines(copy / store.STORE / name / (part + dbs.PACKED))
            assert have == want, f"tuning_logs/_store/{name} is stale: run `python -m deploy pack-databases tuning_logs`"
