"""scripts/db_kernels.py: one line per workload of a committed database, with
the default schedule's time from the kernel check where it has one."""

import json
import shutil
from pathlib import Path

import pytest

from ..conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
DB = ROOT / "tuning_logs" / "resnet50" / "cuda-sm_90-nvidia-h200" / "fp16-nhwc-b64"


def _script():
    return load_script("db_kernels")


@pytest.fixture
def folder(tmp_path):
    if not (DB / "database_workload.json.xz").is_file():
        pytest.skip("the committed ResNet-50 batch-64 database is not in this checkout")
    out = tmp_path / "db"
    out.mkdir()
    for name in ("database_workload.json.xz", "database_tuning_record.json.xz", "key.json"):
        shutil.copy(DB / name, out / name)
    return out


def _checks(folder, chain, workload, default_us):
    (folder / "database_checks.json").write_text(json.dumps({
        "passed": [], "rejected": [], "timed": {}, "chain": chain, "default_rule": {workload: "dlight.Matmul"},
        "default_faster": [{"record": "r", "workload": workload, "record_secs": 9e-5, "tuned_us": 90.0,
                            "default_us": default_us}]}))


def test_rows_name_shapes_tensor_cores_and_the_checks_default_time(folder):
    from deploy.passes.schedule import default_chain

    mod = _script()
    first = mod.rows(folder)
    assert first and all(r["records"] > 0 and r["best_us"] > 0 for r in first)
    assert all(r["default_us"] is None for r in first)  # (no database_checks.json yet)
    assert {r["tensor_cores"] for r in first} <= {"wmma", "mma", "-"}
    w = first[0]["workload"]
    assert len(first[0]["shapes"]) >= 3 and all(s.replace(",", "").isdigit() for s in first[0]["shapes"])

    _checks(folder, default_chain("cuda"), w, 12.5)
    assert {r["workload"]: r["default_us"] for r in mod.rows(folder)}[w] == 12.5
    # timed under an earlier default chain: the time is stale, not shown
    _checks(folder, ["dlight.Matmul", "dlight.Fallback", "default"], w, 12.5)
    assert all(r["default_us"] is None for r in mod.rows(folder))


def test_a_folder_without_a_database_is_one_line_and_exit_2(tmp_path, capsys):
    assert _script().main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no tuning database")
