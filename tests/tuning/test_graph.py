"""deploy/tuning/graph.py: the graph a bucket's database was tuned on, and
the optimize stage keeping it (pipeline.tuned_direct)."""

from __future__ import annotations

import json

import pytest

from deploy import config, pipeline, shapes, targets
from deploy.config import InputSpec
from deploy.tuning import database as dbs
from deploy.tuning import graph


def _db(folder, records=True, says=None):
    folder.mkdir(parents=True)
    if records:
        (folder / (dbs.RECORDS + dbs.PACKED)).write_bytes(b"")
    if says:
        (folder / graph.GRAPH_FILE).write_text(json.dumps({"convolutions": says}))
    return folder


@pytest.mark.parametrize("records, says, batch, want", [
    (True, None, 1, True),  # a database from before: tuned on direct convolutions below CONV_GEMM_BATCH
    (True, None, 8, True),
    (True, None, 32, False),  # (from 32 images the convolutions were GEMMs already)
    (False, None, 1, False),  # no records: nothing to keep
    (True, "implicit-gemm", 1, False),
    (True, "direct", 64, True),  # (tuned with --no-implicit-gemm)
], ids=["old-b1", "old-b8", "old-b32", "empty", "says-implicit", "says-direct-b64"])
def test_a_database_says_or_its_age_tells_which_graph_it_was_tuned_on(tmp_path, records, says, batch, want):
    assert graph.tuned_direct(_db(tmp_path / "db", records, says), batch) is want


def test_the_graph_is_recorded_until_the_database_has_records(tmp_path):
    """A database keeps the graph it was first tuned on; one whose first run
    stopped before any record takes the next run's; an old one (records, no
    graph.json) is left as it is."""
    new = tmp_path / "new"
    graph.record(new, implicit=False)
    graph.record(new, implicit=True)  # (no records yet: the run that tunes it says)
    assert json.loads((new / graph.GRAPH_FILE).read_text()) == {"convolutions": "implicit-gemm"}
    assert not graph.tuned_direct(new, 1)
    (new / (dbs.RECORDS + dbs.PACKED)).write_bytes(b"")
    graph.record(new, implicit=False)
    assert json.loads((new / graph.GRAPH_FILE).read_text()) == {"convolutions": "implicit-gemm"}
    stopped = tmp_path / "stopped"
    graph.record(stopped, implicit=False)  # (says direct, but nothing was tuned: the default graph)
    assert not graph.tuned_direct(stopped, 1)
    old = _db(tmp_path / "old")
    graph.record(old, implicit=True)
    assert not (old / graph.GRAPH_FILE).exists() and graph.tuned_direct(old, 1)


def test_the_buckets_whose_databases_were_tuned_on_direct_convolutions(tmp_path):
    """With databases under the root: an old batch-1 one (direct), a batch-8
    one that says implicit GEMMs, an old batch-32 one: only batch 1 keeps
    direct convolutions; --implicit-gemm or --no-implicit-gemm (the
    profile's implicit_gemm) decides regardless."""
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}})
    target = targets.resolve("cuda:sm_90")
    inputs = (InputSpec("input", (3, 32, 32), "float32"),)
    _, dirs = pipeline.db_keys(cfg, cfg.cuda, target, inputs, tmp_path)
    one, eight, many = (shapes.parse(b) for b in ("1", "8", "32"))
    _db(dirs[one])
    _db(dirs[eight], says="implicit-gemm")
    _db(dirs[many])
    direct = pipeline.tuned_direct(cfg, cfg.cuda, target, inputs, tmp_path)
    assert direct == frozenset({one})
    hopper = True
    assert not cfg.cuda.implicit_gemms(hopper, one in direct) and cfg.cuda.implicit_gemms(hopper, eight in direct)
    asked = config.apply_overrides(cfg, "cuda", implicit_gemm=True)
    assert asked.cuda.implicit_gemms(hopper, one in direct)


def test_the_optimize_stage_makes_the_graph_each_bucket_was_tuned_on(tmp_path, caplog):
    """optimize.run with batch 1 tuned direct: its convolutions stay
    convolutions, the manifest says so (what tune records in a new
    database), and the log says why once; without, implicit GEMMs."""
    from deploy import export, frontend, optimize

    cfg = config.from_dict({"model": {"source": "tiny_cnn"}, "cuda": {"buckets": [1], "trials": 0}})
    target = targets.resolve("cuda:sm_90")
    fe = frontend.run(cfg.cuda, export.run(cfg, tmp_path / "export"), tmp_path / "frontend")
    one = shapes.parse("1")
    with caplog.at_level("INFO"):
        kept = optimize.run(cfg.cuda, target, fe, tmp_path / "direct", tuned_direct=frozenset({one}))
    made = optimize.run(cfg.cuda, target, fe, tmp_path / "implicit")
    assert kept.manifest["implicit_gemms"] == {"1": False} and made.manifest["implicit_gemms"] == {"1": True}
    phases = [[p["phase"] for p in a.manifest["report"]["1"]] for a in (kept, made)]
    assert "implicit_gemm" not in phases[0] and "implicit_gemm" in phases[1]
    assert [r.message for r in caplog.records if "keeps direct" in r.message] == [
        "optimize: bucket 1 keeps direct convolutions: its tuning database was tuned on them "
        "(--implicit-gemm makes them implicit GEMMs)"]
