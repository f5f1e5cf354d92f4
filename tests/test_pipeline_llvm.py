"""Golden tests: tiny models through every stage on llvm, compared with ONNX
Runtime and PyTorch by the validate stage."""

import json

import numpy as np
import pytest
import torch

import deploy
import models
from deploy import artifacts, pipeline
from deploy.errors import ShapeError

from .conftest import make_config

# Every registry model is either run through the whole pipeline here or
# listed as too big for the CPU test budget (its export is tested in test_models).
GOLDEN = ["tiny_cnn", "tiny_mlp", "tiny_vit"]
TOO_BIG_FOR_CPU_TESTS = ["resnet50", "resnet18", "mobilenet_v2"]


def test_every_registered_model_is_covered():
    assert sorted(GOLDEN + TOO_BIG_FOR_CPU_TESTS) == sorted(models.names())


def test_tiny_cnn_package(tiny_package):
    folder, summary, _, _ = tiny_package
    m = json.loads((folder / "manifest.json").read_text())
    assert m["stage"] == "package" and m["target"]["kind"] == "llvm"
    assert set(m["buckets"]) == {"1", "4"}
    assert m["validation"]["passed"] is True
    assert m["inputs"] == [{"name": "input", "shape": [3, 16, 16], "dtype": "float32"}]
    assert m["outputs"] == [{"name": "output", "shape": [10], "dtype": "float32"}]
    for b in m["buckets"].values():
        assert artifacts.sha256_file(folder / b["file"]) == b["sha256"]
    report = json.loads((folder / "validation.json").read_text())
    assert set(report["buckets"]["4"]) == {"onnxruntime", "pytorch"}
    assert summary["validation"]["passed"]
    # every stage left its manifest
    ws = folder.parent
    for stage in ("export", "frontend", "optimize", "package"):
        assert (ws / stage / "manifest.json").is_file()
    assert not [p for p in ws.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_vit"])
def test_golden_models(name, tmp_path, llvm_target):
    cfg = make_config(name, buckets=[2])
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    assert summary["validation"]["worst_rel_l2"] < 1e-4


def test_predictor_matches_pytorch_across_buckets(tiny_package):
    folder, _, cfg, _ = tiny_package
    pred = deploy.load(folder)
    model = models.build("tiny_cnn", seed=cfg.model.seed)
    x = np.random.default_rng(3).standard_normal((11, 3, 16, 16)).astype("float32")  # 4+4+3: split and padded
    out = pred({"input": x})["output"]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert out.shape == (11, 10)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert pred.bucket_for(1) == 1 and pred.bucket_for(3) == 4 and pred.bucket_for(9) == 4
    np.testing.assert_allclose(pred(x[:1])["output"], ref[:1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, x: p({"inp": x}), "unknown input name"),
        (lambda p, x: p({}), "missing input"),
        (lambda p, x: p(x.astype("float64")), "wrong dtype"),
        (lambda p, x: p(x[:, :2]), "wrong shape"),
        (lambda p, x: p(x[0]), "wrong shape"),
        (lambda p, x: p(x, x), "wrong number of inputs"),
        (lambda p, x: p(x[:0]), "empty batch"),
    ],
)
def test_predictor_rejects_bad_inputs(tiny_package, call, message):
    pred = deploy.load(tiny_package[0])
    x = np.zeros((2, 3, 16, 16), "float32")
    with pytest.raises(ShapeError, match=message):
        call(pred, x)


def test_onnx_file_source(tmp_path, llvm_target):
    """A user's ONNX file with its input shapes from the config."""
    from deploy import config

    model = models.build("tiny_cnn", seed=1)
    path = tmp_path / "user.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(path), opset_version=18, dynamo=False,
                      input_names=["pixels"], output_names=["logits"], dynamic_axes={"pixels": {0: "n"}})
    cfg = config.from_dict({
        "model": {"source": str(path), "inputs": [{"name": "pixels", "shape": [3, 16, 16]}]},
        "llvm": {"buckets": [3], "tune_buckets": [3], "trials": 0},
    })
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db")
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "package" / "manifest.json").read_text())
    assert m["model"] == "user" and m["inputs"][0]["name"] == "pixels" and m["outputs"][0]["name"] == "logits"
    report = json.loads((tmp_path / "ws" / "package" / "validation.json").read_text())
    assert set(report["buckets"]["3"]) == {"onnxruntime"}  # no PyTorch model for an ONNX source


def test_fp16_nhwc_on_llvm(tmp_path, llvm_target):
    """The fp16 and layout phases on the CPU, validated with fp16 tolerances."""
    cfg = make_config("tiny_cnn", buckets=[2], tune_buckets=[2], precision="fp16", layout="NHWC")
    summary = pipeline.run(cfg, llvm_target, tmp_path / "ws", db_root=tmp_path / "db", dump_ir=True)
    assert summary["validation"]["passed"]
    m = json.loads((tmp_path / "ws" / "optimize" / "manifest.json").read_text())
    phases = [p["phase"] for p in m["report"]["2"]]
    assert phases == ["input", "fold_batchnorm", "inference", "constant_folding", "layout", "mixed_precision", "fusion"]
    assert m["report"]["2"][-2]["ops"].get("astype", 0) > 0
    assert len(list((tmp_path / "ws" / "optimize" / "ir" / "b2").glob("*.py"))) == 6
