"""Tests for the ``models`` package (registry, architectures, checkpoints, ONNX export)."""

from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

# Make the repo root importable when run as plain `pytest` (not `python -m pytest`).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import models  # noqa: E402

REQUIRED_NAMES = {"resnet50", "resnet18", "mobilenet_v2", "tiny_vit", "tiny_cnn"}
CHEAP_NAMES = ["tiny_cnn", "tiny_mlp", "tiny_vit"]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def built():
    """Cache of models built with seed 0, so each heavy model is built once."""
    cache: dict[str, nn.Module] = {}

    def _get(name: str) -> nn.Module:
        if name not in cache:
            cache[name] = models.build(name, seed=0)
        return cache[name]

    return _get


def sample_input(name: str, batch: int, seed: int = 123) -> torch.Tensor:
    spec = models.get(name)
    g = torch.Generator().manual_seed(seed)
    return torch.randn((batch, *spec.input_shape), generator=g, dtype=getattr(torch, spec.input_dtype))


# --------------------------------------------------------------------------- registry


def test_registry_contents():
    assert REQUIRED_NAMES <= set(models.REGISTRY)
    assert models.names() == list(models.REGISTRY)
    for name, spec in models.REGISTRY.items():
        assert isinstance(spec, models.ModelSpec)
        assert spec.name == name
        assert callable(spec.factory)
        for t in spec.inputs:
            assert isinstance(t.shape, tuple) and all(isinstance(d, int) and d > 0 for d in t.shape)
            assert t.dtype in ("float32", "int64")
        assert spec.description and "\n" not in spec.description
        assert models.get(name) is spec
    with pytest.raises(dataclasses_frozen_error()):
        models.get("tiny_cnn").name = "x"  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unknown_name_suggests_close_match():
    with pytest.raises(KeyError) as excinfo:
        models.get("resnet5")
    msg = str(excinfo.value)
    assert "unknown model 'resnet5'" in msg
    assert "known: " + ", ".join(models.names()) in msg
    assert "did you mean 'resnet50'?" in msg
    assert "\n" not in msg

    with pytest.raises(KeyError, match="did you mean 'mobilenet_v2'"):
        models.build("mobilenetv2")

    with pytest.raises(KeyError) as excinfo:
        models.get("zzzzzzzz")
    assert "did you mean" not in str(excinfo.value)


# --------------------------------------------------------------------------- forward


BASE_NAMES = ["resnet50", "resnet18", "mobilenet_v2", "tiny_vit", "tiny_cnn", "tiny_mlp"]


@pytest.mark.parametrize("name", [n for n in models.names() if n not in BASE_NAMES])
def test_corpus_small_forward_finite(name):
    """Each corpus model's small variant: finite outputs at batch 2, one per declared output."""
    from deploy.config import InputSpec
    from deploy.export import example_inputs

    spec = models.get(name).small
    model = models.build(name, seed=0, size="small")
    xs = example_inputs([InputSpec(t.name, t.shape, t.dtype) for t in spec.inputs], batch=2)
    with torch.no_grad():
        y = model(*xs)
    ys = list(y) if isinstance(y, (tuple, list)) else [y]
    assert len(ys) == len(spec.outputs)
    for o in ys:
        assert o.shape[0] == 2 and torch.isfinite(o).all() and o.abs().max() < 1e4


@pytest.mark.parametrize("name", BASE_NAMES)
def test_forward_batch2_finite(built, name):
    model = built(name)
    assert not model.training
    assert all(not m.training for m in model.modules())
    x = sample_input(name, batch=2)
    with torch.no_grad():
        y = model(x)
    assert y.ndim == 2 and y.shape[0] == 2
    expected_classes = 1000 if name in {"resnet50", "resnet18", "mobilenet_v2"} else 10
    assert y.shape[1] == expected_classes
    assert torch.isfinite(y).all()
    assert y.abs().max() > 0


# --------------------------------------------------------------------------- architectures


def _torchvision_resnet_keys(layers, bottleneck):
    """Expected torchvision ResNet state_dict keys, generated independently."""
    bn = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    keys = ["conv1.weight"] + [f"bn1.{s}" for s in bn]
    n_convs = 3 if bottleneck else 2
    for li, n_blocks in enumerate(layers, start=1):
        for b in range(n_blocks):
            p = f"layer{li}.{b}"
            for c in range(1, n_convs + 1):
                keys.append(f"{p}.conv{c}.weight")
                keys += [f"{p}.bn{c}.{s}" for s in bn]
            if b == 0 and (bottleneck or li > 1):
                keys.append(f"{p}.downsample.0.weight")
                keys += [f"{p}.downsample.1.{s}" for s in bn]
    keys += ["fc.weight", "fc.bias"]
    return keys


def test_resnet50_matches_torchvision_layout(built):
    model = built("resnet50")
    sd = model.state_dict()
    assert n_params(model) == 25_557_032
    assert len(sd) == 320
    assert list(sd) == _torchvision_resnet_keys([3, 4, 6, 3], bottleneck=True)
    for key in ("layer4.2.bn3.running_var", "fc.weight", "layer1.0.downsample.0.weight", "bn1.num_batches_tracked"):
        assert key in sd
    assert tuple(sd["fc.weight"].shape) == (1000, 2048)
    assert tuple(sd["conv1.weight"].shape) == (64, 3, 7, 7)
    assert tuple(sd["layer4.2.conv3.weight"].shape) == (2048, 512, 1, 1)
    assert tuple(sd["layer2.0.downsample.0.weight"].shape) == (512, 256, 1, 1)
    # v1.5: the stride sits on the 3x3 conv2, not on conv1.
    assert model.layer2[0].conv1.stride == (1, 1)
    assert model.layer2[0].conv2.stride == (2, 2)
    assert model.layer2[0].downsample[0].stride == (2, 2)
    assert isinstance(model.avgpool, nn.AdaptiveAvgPool2d) and model.avgpool.output_size == (1, 1)
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert isinstance(model.layer1[0].downsample, nn.Sequential)


def test_resnet18_matches_torchvision_layout(built):
    model = built("resnet18")
    sd = model.state_dict()
    assert n_params(model) == 11_689_512
    assert list(sd) == _torchvision_resnet_keys([2, 2, 2, 2], bottleneck=False)


def test_resnet_torchvision_init():
    torch.manual_seed(0)
    model = models.resnet50()  # raw factory: torchvision init, untouched BN
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    # kaiming_normal_(fan_out, relu): std = sqrt(2 / (out_ch * k * k))
    w = model.layer3[0].conv2.weight  # 256 out channels, 3x3
    expected_std = math.sqrt(2.0 / (256 * 9))
    assert abs(w.std().item() / expected_std - 1) < 0.05


def test_mobilenet_v2_matches_torchvision_layout(built):
    model = built("mobilenet_v2")
    sd = model.state_dict()
    assert n_params(model) == 3_504_872
    assert len(sd) == 314
    for key in (
        "features.0.0.weight",
        "features.0.1.running_var",
        "features.1.conv.0.0.weight",  # t=1 block: depthwise first
        "features.1.conv.1.weight",
        "features.2.conv.0.0.weight",  # expansion 1x1
        "features.2.conv.1.0.weight",  # depthwise
        "features.2.conv.2.weight",  # projection
        "features.17.conv.3.running_var",
        "features.18.0.weight",
        "features.18.1.num_batches_tracked",
        "classifier.1.weight",
        "classifier.1.bias",
    ):
        assert key in sd, key
    assert tuple(sd["features.18.0.weight"].shape) == (1280, 320, 1, 1)
    assert tuple(sd["features.2.conv.1.0.weight"].shape) == (96, 1, 3, 3)
    assert tuple(sd["classifier.1.weight"].shape) == (1000, 1280)
    assert isinstance(model.classifier[0], nn.Dropout) and model.classifier[0].p == 0.2
    assert len(model.features) == 19
    assert sum(isinstance(m, nn.ReLU6) for m in model.modules()) == 35
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 17 and all(m.groups == m.in_channels for m in depthwise)


def test_transformer_uses_explicit_attention(built):
    model = built("tiny_vit")
    kinds = {type(m) for m in model.modules()}
    assert nn.MultiheadAttention not in kinds
    assert nn.TransformerEncoderLayer not in kinds
    assert nn.LayerNorm in kinds and nn.GELU in kinds


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", CHEAP_NAMES + ["resnet18"])
def test_build_is_deterministic(name):
    a = models.build(name, seed=0).state_dict()
    b = models.build(name, seed=0).state_dict()
    c = models.build(name, seed=1).state_dict()
    assert list(a) == list(b) == list(c)
    assert all(torch.equal(a[k], b[k]) for k in a)
    float_keys = [k for k in a if a[k].is_floating_point()]
    assert any(not torch.equal(a[k], c[k]) for k in float_keys)


def test_build_randomizes_batchnorm():
    model = models.build("tiny_cnn", seed=3)
    for bn in (model.bn1, model.bn2):
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert torch.all(bn.running_var >= 0.5) and torch.all(bn.running_var <= 1.5)
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))
        assert not torch.allclose(bn.bias, torch.zeros_like(bn.bias))


# --------------------------------------------------------------------------- checkpoints


def _forward(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("wrapper", ["state_dict", "model", None])
def test_checkpoint_round_trip(tmp_path, wrapper):
    src = models.build("tiny_cnn", seed=7)
    sd = {"module." + k: v for k, v in src.state_dict().items()}
    payload = {wrapper: sd, "epoch": 3} if wrapper else sd
    path = tmp_path / "ckpt.pt"
    torch.save(payload, path)

    x = sample_input("tiny_cnn", batch=2)
    fresh = models.build("tiny_cnn", seed=8)
    assert not torch.equal(_forward(fresh, x), _forward(src, x))
    loaded = models.build("tiny_cnn", seed=8, checkpoint=path)
    assert not loaded.training
    assert torch.equal(_forward(loaded, x), _forward(src, x))
    # str path works as well as PathLike
    loaded2 = models.build("tiny_cnn", seed=9, checkpoint=str(path))
    assert torch.equal(_forward(loaded2, x), _forward(src, x))


def test_checkpoint_wrong_key_raises_value_error(tmp_path):
    sd = models.build("tiny_cnn", seed=0).state_dict()
    sd["bogus_layer.weight"] = sd.pop("fc.weight")
    path = tmp_path / "bad.pt"
    torch.save({"state_dict": sd}, path)
    with pytest.raises(ValueError) as excinfo:
        models.build("tiny_cnn", checkpoint=path)
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert str(path) in msg
    assert "bogus_layer.weight" in msg and "fc.weight" in msg
    assert "1 missing" in msg and "1 unexpected" in msg


def test_checkpoint_shape_mismatch_raises_value_error(tmp_path):
    sd = models.build("tiny_cnn", seed=0).state_dict()
    sd["fc.weight"] = torch.zeros(3, 3)
    path = tmp_path / "shape.pt"
    torch.save(sd, path)
    with pytest.raises(ValueError, match="fc.weight") as excinfo:
        models.build("tiny_cnn", checkpoint=path)
    assert "\n" not in str(excinfo.value)


def test_checkpoint_missing_file(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError) as excinfo:
        models.build("tiny_cnn", checkpoint=path)
    assert str(path) in str(excinfo.value) and "\n" not in str(excinfo.value)


# --------------------------------------------------------------------------- ONNX export


@pytest.mark.parametrize("name", ["tiny_cnn", "tiny_vit", "mobilenet_v2", "resnet50"])
def test_onnx_export_matches_pytorch(built, tmp_path, name):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")

    model = built(name)
    f = os.fspath(tmp_path / f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            sample_input(name, batch=2),
            f,
            opset_version=17,
            dynamo=False,
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        )
    proto = onnx.load(f)
    onnx.checker.check_model(proto)
    assert {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")} == {17}

    sess = ort.InferenceSession(f, providers=["CPUExecutionProvider"])
    # batch 3 != export batch 2: checks the batch axis really is dynamic
    x = sample_input(name, batch=3, seed=5)
    (got,) = sess.run(["output"], {"input": x.numpy()})
    ref = _forward(model, x).numpy()
    assert got.shape == ref.shape
    # 1e-4 absolute for O(1) logits; relative to the output scale for resnet50,
    # whose random-weight logits are O(100).
    scale = max(1.0, float(np.abs(ref).max()))
    assert float(np.abs(got - ref).max()) <= 1e-4 * scale
