"""scripts/db_coverage.py: how much of each committed database its model's
kernels still use (what the build's stale-database warning looks at)."""

import json
import shutil
from pathlib import Path

import pytest

from ..conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda-sm_90-nvidia-h200"
DB = ROOT / "tuning_logs" / "resnet18" / DEVICE / "fp16-nhwc-b1"


def test_bad_arguments_get_one_line_and_exit_2(tmp_path, capsys):
    script = load_script("db_coverage")
    assert script.main(["--root", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "--root is not a folder" in capsys.readouterr().err
    assert script.main(["--root", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no database under" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_database_row_counts_the_kernels_with_records(tmp_path):
    if not (DB / "key.json").is_file():
        pytest.skip("the committed ResNet-18 database is not in this checkout")
    root = tmp_path / "root"
    shutil.copytree(DB, root / "resnet18" / DEVICE / DB.name)
    script = load_script("db_coverage")
    assert script.main(["--root", str(root), "--out", str(tmp_path / "o")]) == 0
    (row,) = json.loads((tmp_path / "o" / "coverage.json").read_text())
    assert "error" not in row, row
    assert row["bucket"] == "1" and row["kernels"] > 0
    assert 0 < row["kernels_with_records"] <= row["kernels"] and row["records_of_other_kernels"] >= 0
    # the build's rule decides the column
    from deploy.build import stale_database

    info = {"kernels": row["kernels"], "database": {"path": row["database"], **{
        k: row[k] for k in ("kernels_with_records", "records_of_other_kernels")}}}
    assert row["stale"] == (stale_database(info) is not None)
    assert "| " + str(root / "resnet18") in (tmp_path / "o" / "coverage.md").read_text()
