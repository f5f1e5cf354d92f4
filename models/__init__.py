"""Model zoo for the deployment pipeline: PyTorch definitions with random weights.

Usage::

    import models
    spec = models.get("resnet50")          # ModelSpec (factory, input shape, ...)
    net = models.build("resnet50", seed=0) # deterministic weights, eval() mode

``build`` re-initialises every BatchNorm layer's running statistics and affine
parameters with seeded random values so that BN folding in the compiler is
actually exercised (a freshly-constructed BN is an identity map).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .corpus import CORPUS
from .mobilenet import mobilenet_v2
from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50
from .spec import SIZES, ModelSpec, TensorSpec
from .tiny import tiny_cnn, tiny_mlp
from .transformer import tiny_vit

__all__ = [
    "ModelSpec",
    "SIZES",
    "TensorSpec",
    "REGISTRY",
    "UnknownModelError",
    "build",
    "get",
    "names",
    "mobilenet_v2",
    "resnet18",
    "resnet50",
    "tiny_cnn",
    "tiny_mlp",
    "tiny_vit",
]


def _spec(name: str, factory: Callable[[], nn.Module], input_shape: tuple[int, ...], description: str) -> ModelSpec:
    return ModelSpec(name=name, factory=factory, inputs=(TensorSpec("input", tuple(input_shape)),), description=description)


_BASE = (
    _spec(
        "resnet50",
        resnet50,
        (3, 224, 224),
        "ResNet-50 v1.5, torchvision-identical (25.6M params, 1000 classes)",
    ),
    _spec(
        "resnet18",
        resnet18,
        (3, 224, 224),
        "ResNet-18, torchvision-identical (11.7M params, 1000 classes)",
    ),
    _spec(
        "mobilenet_v2",
        mobilenet_v2,
        (3, 224, 224),
        "MobileNetV2 depthwise-separable CNN, torchvision-identical (3.5M params, 1000 classes)",
    ),
    _spec(
        "tiny_vit",
        tiny_vit,
        (3, 32, 32),
        "Small ViT encoder (4x4 patches, 3 layers, dim 128, 4 heads, explicit attention, 10 classes)",
    ),
    _spec(
        "tiny_cnn",
        tiny_cnn,
        (3, 16, 16),
        "Tiny CNN (Conv-BN-ReLU x2, global avgpool, Linear; 10 classes) for fast tests",
    ),
    _spec(
        "tiny_mlp",
        tiny_mlp,
        (64,),
        "Tiny MLP (3 Linear layers with ReLU, 64 -> 10) for fast tests",
    ),
)


def _small(spec: ModelSpec, factory: Callable[[], nn.Module], shape: tuple[int, ...], description: str) -> ModelSpec:
    return dataclasses.replace(spec, small=_spec(spec.name, factory, shape, description))


# Small variants of the classic CNNs (the same blocks, fewer of them, 64x64 inputs): the test suite's size.
_SMALL = {
    "resnet50": (lambda: ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10), (3, 64, 64),
                 "ResNet-50's bottleneck blocks, one per stage, 64x64 (10 classes)"),
    "resnet18": (lambda: ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10), (3, 64, 64),
                 "ResNet-18's basic blocks, one per stage, 64x64 (10 classes)"),
    "mobilenet_v2": (lambda: mobilenet_v2(num_classes=10), (3, 64, 64), "MobileNetV2 on 64x64 (10 classes)"),
}

_KINDS = {"tiny_vit": "transformer", "tiny_mlp": "other"}  # the rest of _BASE are CNNs


def _base(spec: ModelSpec) -> ModelSpec:
    if spec.name in _SMALL:
        spec = _small(spec, *_SMALL[spec.name])
    return dataclasses.replace(spec, kind=_KINDS.get(spec.name, spec.kind))


REGISTRY: dict[str, ModelSpec] = {s.name: s for s in (*(_base(b) for b in _BASE), *CORPUS)}


class UnknownModelError(KeyError):
    """KeyError whose str() is the plain message (KeyError normally repr()s it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def names() -> list[str]:
    """Registered model names, in registry order."""
    return list(REGISTRY)


def get(name: str) -> ModelSpec:
    """Look up a model spec; unknown names raise KeyError with a suggestion."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        pass
    known = names()
    msg = f"unknown model {name!r} | known: {', '.join(known)}"
    if isinstance(name, str):
        lowered = {k.lower(): k for k in known}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
        if close:
            msg += f" | did you mean {lowered[close[0]]!r}?"
    raise UnknownModelError(msg)


def _randomize_batchnorm(model: nn.Module) -> None:
    """Give every BatchNorm non-trivial, seeded statistics and affine params.

    running_mean ~ N(0, 0.1), running_var ~ U(0.5, 1.5), weight ~ U(0.8, 1.2),
    bias ~ N(0, 0.1).  Uses the global torch RNG (already seeded by ``build``).
    The weight is kept near 1 so activations of deep nets stay well scaled.
    """
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                continue
            if m.running_mean is not None:
                m.running_mean.normal_(0.0, 0.1)
            if m.running_var is not None:
                m.running_var.uniform_(0.5, 1.5)
            if m.weight is not None:
                m.weight.uniform_(0.8, 1.2)
            if m.bias is not None:
                m.bias.normal_(0.0, 0.1)


def _preview(keys: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    if len(keys) > limit:
        shown += ", ..."
    return f"[{shown}]"


def _extract_state_dict(obj: Any, path: str) -> dict[str, torch.Tensor]:
    if isinstance(obj, collections.abc.Mapping):
        for wrapper_key in ("state_dict", "model"):
            inner = obj.get(wrapper_key)
            if isinstance(inner, collections.abc.Mapping):
                obj = inner
                break
    if not isinstance(obj, collections.abc.Mapping):
        raise ValueError(f"checkpoint '{path}' does not contain a state_dict (got {type(obj).__name__})")
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        key = str(key)
        if key.startswith("module."):
            key = key[len("module.") :]
        out[key] = value
    return out


def _load_checkpoint(model: nn.Module, name: str, checkpoint: Union[str, os.PathLike]) -> None:
    path = os.fspath(checkpoint)
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint not found: '{path}'")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised as a one-line ValueError
        detail = " ".join(str(exc).split())[:300]
        raise ValueError(f"checkpoint '{path}' could not be loaded: {type(exc).__name__}: {detail}") from exc
    state_dict = _extract_state_dict(obj, path)

    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mismatched = [
        k
        for k in expected
        if k in state_dict
        and isinstance(state_dict[k], torch.Tensor)
        and tuple(state_dict[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mismatched:
        parts = [
            f"{len(missing)} missing key(s) {_preview(missing)}",
            f"{len(unexpected)} unexpected key(s) {_preview(unexpected)}",
        ]
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es) {_preview(mismatched)}")
        raise ValueError(f"checkpoint '{path}' does not match model '{name}': " + "; ".join(parts))
    try:
        model.load_state_dict(state_dict, strict=True)
    except Exception as exc:  # noqa: BLE001 - re-raised as a one-line ValueError
        detail = " ".join(str(exc).split())[:300]
        raise ValueError(f"checkpoint '{path}' could not be loaded into model '{name}': {detail}") from exc


def build(
    name: str,
    seed: int = 0,
    checkpoint: Optional[Union[str, os.PathLike]] = None,
    size: str = "full",
) -> torch.nn.Module:
    """Construct model ``name`` with deterministic random weights, in eval() mode.

    ``torch.manual_seed(seed)`` is called before construction, then BatchNorm
    layers get seeded random statistics/affine parameters.  If ``checkpoint``
    is given it is loaded on top (strict): a raw state_dict or a dict holding
    one under "state_dict" or "model"; a leading "module." prefix is stripped.
    ``size="small"`` builds the model's small variant (see ``ModelSpec.small``).
    """
    spec = get(name).sized(size)
    torch.manual_seed(seed)
    model = spec.factory()
    _randomize_batchnorm(model)
    if checkpoint is not None:
        _load_checkpoint(model, spec.name, checkpoint)
    model.eval()
    return model
