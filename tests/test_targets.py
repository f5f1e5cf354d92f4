"""CPU targets by x86-64 level: what tuning databases and packages are keyed
by, and what a machine of another level, or another GPU, is told."""

import dataclasses
import json
import logging

import pytest

from deploy import targets
from deploy.errors import TargetError

from .conftest import make_config


def test_a_cpu_is_named_by_its_x86_64_level():
    assert targets.cpu_level("znver3") == "x86-64-v3"
    assert targets.cpu_level("znver4") == "x86-64-v4"
    assert targets.cpu_level("emeraldrapids") == "x86-64-v4"
    assert targets.cpu_level("haswell") == "x86-64-v3"
    assert targets.cpu_level("nehalem") == "x86-64-v2"
    assert targets.cpu_level("core2") == "core2"  # below v2: the model itself
    assert [targets.level_rank(f"x86-64-v{i}") for i in (2, 3, 4)] == [1, 2, 3]
    assert targets.level_rank("znver4") is None


def test_the_cpu_target_is_its_level_and_its_key_holds_neither_model_nor_cores():
    here = targets.resolve("llvm")
    spec = json.loads(here.spec)
    assert spec["mcpu"] == here.arch and here.slug == f"llvm-{here.arch}"
    from deploy.tvm_compat import target_codegen

    assert here.device_name == target_codegen.llvm_get_system_cpu()  # the model, for the record
    key = here.key()
    assert key["device"] == "" and "num-cores" not in json.loads(key["target"])
    # another machine of the same level: another model, other cores, the same key (and database)
    other = dataclasses.replace(here, spec=json.dumps({**spec, "num-cores": spec["num-cores"] + 14}),
                                device_name="some-other-cpu")
    assert other.key() == key and other.slug == here.slug


def test_a_package_for_a_higher_level_is_refused_in_one_line(monkeypatch):
    from deploy import runtime
    from deploy.tvm_compat import target_codegen

    monkeypatch.setattr(target_codegen, "llvm_get_system_cpu", lambda: "haswell")  # x86-64-v3
    runtime.check_cpu_level("x86-64-v3")
    runtime.check_cpu_level("x86-64-v2")
    runtime.check_cpu_level("znver4")  # a package keyed by the CPU model (before levels): not judged
    with pytest.raises(TargetError, match=r"built for a CPU level this machine lacks \| got x86-64-v3 \(haswell\) "
                                          r"\| expected x86-64-v4 or higher"):
        runtime.check_cpu_level("x86-64-v4")


def test_databases_of_another_level_are_named(tmp_path, caplog):
    from deploy import pipeline
    from deploy.config import InputSpec
    from deploy.tuning import database as dbs

    cfg = make_config()
    here = targets.resolve("llvm")
    inputs = (InputSpec("x", (3, 16, 16)),)
    _, dirs = pipeline.db_keys(cfg, cfg.llvm, here, inputs, tmp_path)
    other = tmp_path / cfg.model.name / "llvm-x86-64-v9" / next(iter(dirs.values())).name
    other.mkdir(parents=True)
    (other / (dbs.RECORDS + dbs.PACKED)).write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        _, found = pipeline.existing_databases(cfg, cfg.llvm, here, inputs, tmp_path)
    assert found == {}
    assert f"has CPU tuning databases for x86-64-v9, not for this machine's {here.arch}" in caplog.text


def test_databases_of_another_gpu_are_named(tmp_path, caplog):
    """An H100 user of a model whose committed databases are the H200's:
    the build says why nothing is tuned, naming the GPU they were tuned on."""
    from deploy import pipeline
    from deploy.config import InputSpec
    from deploy.tuning import database as dbs

    cfg = make_config()
    h100 = targets.TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H100 80GB HBM3", True)
    h200 = targets.TargetInfo("cuda", '{"arch": "sm_90", "kind": "cuda"}', "sm_90", "NVIDIA H200", True)
    inputs = (InputSpec("x", (3, 16, 16)),)
    _, dirs = pipeline.db_keys(cfg, cfg.cuda, h200, inputs, tmp_path)
    (bucket, own), *_ = dirs.items()
    # another bucket's database on the H200 (batch 999, which this build lacks): not a reason to warn
    elsewhere = own.parent / own.name.replace(f"-b{bucket.batch}", "-b999")
    for folder in (elsewhere, own):
        folder.mkdir(parents=True)
        (folder / (dbs.RECORDS + dbs.PACKED)).write_bytes(b"")
        (folder / dbs.KEY_FILE).write_text(json.dumps({"target": h200.key()}))
        with caplog.at_level(logging.WARNING):
            _, found = pipeline.existing_databases(cfg, cfg.cuda, h100, inputs, tmp_path)
        assert found == {}
        warned = "has tuning databases of these buckets for NVIDIA H200, not for this GPU (NVIDIA H100 80GB HBM3)"
        assert (warned in caplog.text) == (folder == own), caplog.text
        caplog.clear()
    with caplog.at_level(logging.WARNING):  # the H200 itself finds its own (no warning)
        _, found = pipeline.existing_databases(cfg, cfg.cuda, h200, inputs, tmp_path)
    assert found == {bucket: own}
    assert "tuning databases" not in caplog.text
