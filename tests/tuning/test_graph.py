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


def test_the_graph_is_recorded_once_and_only_in_a_new_database(tmp_path):
    new = tmp_path / "new"
    graph.record(new, implicit=True)
    graph.record(new, implicit=False)  # (kept: a database keeps the graph it was first tuned on)
    assert json.loads((new / graph.GRAPH_FILE).read_text()) == {"convolutions": "implicit-gemm"}
    old = _db(tmp_path / "old")
    graph.record(old, implicit=True)  # (records and no graph.json: as old as the rule, left as it is)
    assert not (old / graph.GRAPH_FILE).exists() and graph.tuned_direct(old, 1)


def test_the_optimize_stage_keeps_direct_convolutions_where_a_database_was_tuned_on_them(tmp_path, caplog):
    """With databases under the root: an old batch-1 one (direct), a batch-8
    one that says implicit GEMMs, an old batch-32 one: only batch 1 keeps
    direct convolutions, and the log says so once; --implicit-gemm or
    --no-implicit-gemm (the profile's implicit_gemm) decides regardless."""
    cfg = config.from_dict({"model": {"source": "tiny_cnn"}})
    target = targets.resolve("cuda:sm_90")
    inputs = (InputSpec("input", (3, 32, 32), "float32"),)
    _, dirs = pipeline.db_keys(cfg, cfg.cuda, target, inputs, tmp_path)
    one, eight, many = (shapes.parse(b) for b in ("1", "8", "32"))
    _db(dirs[one])
    _db(dirs[eight], says="implicit-gemm")
    _db(dirs[many])
    with caplog.at_level("INFO"):
        direct = pipeline.tuned_direct(cfg, cfg.cuda, target, inputs, tmp_path)
    assert direct == frozenset({one})
    assert [r.message for r in caplog.records if "keep direct convolutions" in r.message] == [
        "optimize: bucket(s) 1 keep direct convolutions: their tuning databases were tuned on them "
        "(--implicit-gemm makes them implicit GEMMs)"]
    hopper = True
    assert not cfg.cuda.implicit_gemms(hopper, one in direct) and cfg.cuda.implicit_gemms(hopper, eight in direct)
    asked = config.apply_overrides(cfg, "cuda", implicit_gemm=True)
    assert asked.cuda.implicit_gemms(hopper, one in direct)
