"""scripts/conv_vs_cudnn.py: a database's convolutions against torch's conv2d
on the same shapes (cuDNN on the GPU machine; here, torch on the CPU, which
checks the script, not the comparison)."""

import json
from pathlib import Path

import pytest

from ..conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
DB = ROOT / "tuning_logs" / "resnet50" / "cuda-sm_90-nvidia-h200" / "fp16-nhwc-b64"


def _script():
    return load_script("conv_vs_cudnn")


def test_the_convolution_is_read_from_the_buffers_shapes():
    p = _script().conv_params
    same = p(["64,56,56,64", "64,3,3,64", "1,1,1,64", "64,56,56,64"])
    assert (same["kernel"], same["stride"], same["padding"]) == (3, 1, 1)
    assert same["gflop"] == pytest.approx(2 * 64 * 56 * 56 * 64 * 9 * 64 / 1e9)
    assert p(["64,56,56,128", "128,3,3,128", "1,1,1,128", "64,28,28,128"])["stride"] == 2
    down = p(["64,56,56,256", "512,1,1,256", "1,1,1,512", "64,28,28,512"])
    assert (down["kernel"], down["stride"], down["padding"]) == (1, 2, 0)
    stem = p(["64,224,224,3", "64,7,7,3", "1,1,1,64", "64,112,112,64"])
    assert (stem["kernel"], stem["stride"], stem["padding"]) == (7, 2, 3)
    patches = p(["32,224,224,3", "96,4,4,3", "1,1,1,96", "32,56,56,96"])  # (ConvNeXt's stem)
    assert (patches["kernel"], patches["stride"], patches["padding"]) == (4, 4, 0)
    assert p(["200704,64", "64,256", "1,256", "200704,256"]) is None  # a GEMM
    assert p(["64,56,56,64", "64,3,3,32", "64,56,56,64"]) is None  # grouped
    assert p(["64,56,56,64", "64,3,3,64", "64,50,50,64"]) is None  # no stride gives that output


def test_a_table_of_the_databases_convolutions(tmp_path):
    if not (DB / "database_workload.json.xz").is_file():
        pytest.skip("the committed ResNet-50 batch-64 database is not in this checkout")
    mod = _script()
    out = tmp_path / "out"
    assert mod.main([str(DB), "--out", str(out), "--device", "cpu", "--dtype", "float32", "--iters", "1",
                     "--limit", "1"]) == 2  # (an fp16 database: the dtype must match)
    fp32 = tmp_path / "fp32-nhwc-b64"  # (the same database under an fp32 profile's name, to run on the CPU)
    fp32.mkdir()
    for f in DB.iterdir():
        (fp32 / f.name).write_bytes(f.read_bytes())
    assert mod.main([str(fp32), "--out", str(out), "--device", "cpu", "--dtype", "float32", "--iters", "1",
                     "--limit", "1"]) == 0
    got = json.loads((out / "conv_vs_cudnn.json").read_text())
    (row,) = got["rows"]
    want = next(r for r in mod.db_kernels.rows(fp32) if r["workload"] == row["workload"])
    assert row["tvm_us"] == round(min(t for t in (want["best_us"], want["default_us"]) if t), 2)
    assert row["torch_us"] > 0 and row["tvm_tflops"] == pytest.approx(row["gflop"] / row["tvm_us"] * 1e3, rel=1e-2)
    assert "| TVM / torch |" in (out / "conv_vs_cudnn.md").read_text()


def test_bad_inputs_get_one_line_and_exit_2(tmp_path, capsys):
    mod = _script()
    assert mod.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no tuning database" in capsys.readouterr().err
    if DB.is_dir():
        assert mod.main([str(DB), "--out", str(tmp_path / "o"), "--limit", "-1"]) == 2
        assert "--limit at least 0" in capsys.readouterr().err
    if DB.is_dir():
        import torch

        if not torch.cuda.is_available():
            assert mod.main([str(DB), "--out", str(tmp_path / "o")]) == 2
            assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
