"""Mobile-class CNNs: MobileNetV3-Small, EfficientNet-B0, ShuffleNetV2, SqueezeNet 1.1.

Layouts follow the torchvision definitions (stage tables, squeeze-excitation
placement, activations) but are written in plain torch, with a ``width_mult``
and a smaller stage table for the corpus' small variants.  Every reshape uses
static channel counts (``unflatten``/``flatten``) so the exported ONNX graph
keeps a dynamic batch dimension.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Type

import torch
from torch import nn

from .mobilenet import _make_divisible

__all__ = [
    "ConvBNAct",
    "SqueezeExcitation",
    "MobileNetV3",
    "EfficientNet",
    "ShuffleNetV2",
    "SqueezeNet",
    "mobilenet_v3",
    "efficientnet_b0",
    "shufflenet_v2",
    "squeezenet",
]


class ConvBNAct(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d -> activation (None: no activation)."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        kernel_size: int = 3,
        stride: int = 1,
        groups: int = 1,
        act: Optional[Type[nn.Module]] = nn.ReLU,
    ) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """Global average pool -> 1x1 conv -> act -> 1x1 conv -> gate (x * gate)."""

    def __init__(
        self,
        channels: int,
        squeeze: int,
        act: Type[nn.Module] = nn.ReLU,
        gate: Type[nn.Module] = nn.Sigmoid,
    ) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.act = act()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.gate(self.fc2(self.act(self.fc1(self.avgpool(x)))))
        return x * s


def _init_cnn(model: nn.Module, linear_std: float = 0.01) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, linear_std)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------- MobileNetV3


class V3Block(nn.Module):
    """MobileNetV3 inverted residual: expand 1x1 -> depthwise kxk -> [SE] -> project 1x1."""

    def __init__(self, inp: int, k: int, exp: int, out: int, use_se: bool, act: str, stride: int) -> None:
        super().__init__()
        act_layer: Type[nn.Module] = nn.Hardswish if act == "HS" else nn.ReLU
        self.use_res = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if exp != inp:
            layers.append(ConvBNAct(inp, exp, 1, act=act_layer))
        layers.append(ConvBNAct(exp, exp, k, stride, groups=exp, act=act_layer))
        if use_se:
            layers.append(SqueezeExcitation(exp, _make_divisible(exp // 4, 8), nn.ReLU, nn.Hardsigmoid))
        layers.append(ConvBNAct(exp, out, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_res else y


# in, kernel, expanded, out, SE, activation, stride  (torchvision mobilenet_v3_small)
V3_SMALL = (
    (16, 3, 16, 16, True, "RE", 2),
    (16, 3, 72, 24, False, "RE", 2),
    (24, 3, 88, 24, False, "RE", 1),
    (24, 5, 96, 40, True, "HS", 2),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 240, 40, True, "HS", 1),
    (40, 5, 120, 48, True, "HS", 1),
    (48, 5, 144, 48, True, "HS", 1),
    (48, 5, 288, 96, True, "HS", 2),
    (96, 5, 576, 96, True, "HS", 1),
    (96, 5, 576, 96, True, "HS", 1),
)


class MobileNetV3(nn.Module):
    def __init__(
        self,
        setting: Sequence[tuple] = V3_SMALL,
        width_mult: float = 1.0,
        last_channel: int = 1024,
        num_classes: int = 1000,
        dropout: float = 0.2,
    ) -> None:
        super().__init__()

        def w(c: int) -> int:
            return _make_divisible(c * width_mult, 8)

        layers: list[nn.Module] = [ConvBNAct(3, w(setting[0][0]), 3, 2, act=nn.Hardswish)]
        for inp, k, exp, out, se, act, s in setting:
            layers.append(V3Block(w(inp), k, w(exp), w(out), se, act, s))
        last_in = w(setting[-1][3])
        last_conv = 6 * last_in
        layers.append(ConvBNAct(last_in, last_conv, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(last_conv, last_channel),
            nn.Hardswish(),
            nn.Dropout(dropout),
            nn.Linear(last_channel, num_classes),
        )
        _init_cnn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x)).flatten(1)
        return self.classifier(x)


def mobilenet_v3(width_mult: float = 1.0, last_channel: int = 1024, num_classes: int = 1000,
                 setting: Sequence[tuple] = V3_SMALL) -> MobileNetV3:
    """MobileNetV3-Small layout (2.5M params at width 1.0 / 1000 classes)."""
    return MobileNetV3(setting, width_mult, last_channel, num_classes)


# --------------------------------------------------------------------------- EfficientNet


class MBConv(nn.Module):
    """EfficientNet MBConv: [expand 1x1] -> depthwise kxk -> SE(SiLU, sigmoid) -> project 1x1."""

    def __init__(self, inp: int, out: int, expand: int, k: int, stride: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNAct(inp, hidden, 1, act=nn.SiLU))
        layers.append(ConvBNAct(hidden, hidden, k, stride, groups=hidden, act=nn.SiLU))
        layers.append(SqueezeExcitation(hidden, max(1, inp // 4), nn.SiLU, nn.Sigmoid))
        layers.append(ConvBNAct(hidden, out, 1, act=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_res else y  # stochastic depth is identity in eval


# expand, kernel, stride, in, out, repeats  (EfficientNet-B0)
B0_STAGES = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


class EfficientNet(nn.Module):
    def __init__(
        self,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        num_classes: int = 1000,
        dropout: float = 0.2,
        stages: Sequence[tuple] = B0_STAGES,
    ) -> None:
        super().__init__()

        def w(c: int) -> int:
            return _make_divisible(c * width_mult, 8)

        stem = w(stages[0][3])
        layers: list[nn.Module] = [ConvBNAct(3, stem, 3, 2, act=nn.SiLU)]
        for e, k, s, inp, out, n in stages:
            reps = int(math.ceil(n * depth_mult))
            for i in range(reps):
                layers.append(MBConv(w(inp) if i == 0 else w(out), w(out), e, k, s if i == 0 else 1))
        head = 4 * w(stages[-1][4])
        layers.append(ConvBNAct(w(stages[-1][4]), head, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(head, num_classes))
        _init_cnn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x)).flatten(1)
        return self.classifier(x)


def efficientnet_b0(width_mult: float = 1.0, depth_mult: float = 1.0, num_classes: int = 1000) -> EfficientNet:
    """EfficientNet-B0 layout (5.3M params at width/depth 1.0 / 1000 classes)."""
    return EfficientNet(width_mult, depth_mult, num_classes)


# --------------------------------------------------------------------------- ShuffleNetV2


def channel_shuffle(x: torch.Tensor, channels: int, groups: int = 2) -> torch.Tensor:
    """[B, C, H, W] -> interleave the ``groups`` channel groups (static channel numbers)."""
    return x.unflatten(1, (groups, channels // groups)).transpose(1, 2).flatten(1, 2)


class ShuffleUnit(nn.Module):
    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.out = out
        branch = out // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                ConvBNAct(inp, inp, 3, stride, groups=inp, act=None),
                ConvBNAct(inp, branch, 1),
            )
            b2_in = inp
        else:
            self.branch1 = None
            b2_in = branch
        self.branch2 = nn.Sequential(
            ConvBNAct(b2_in, branch, 1),
            ConvBNAct(branch, branch, 3, stride, groups=branch, act=None),
            ConvBNAct(branch, branch, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch1 is None:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, self.out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(
        self,
        stages_repeats: Sequence[int] = (4, 8, 4),
        stages_out_channels: Sequence[int] = (24, 116, 232, 464, 1024),
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        c0 = stages_out_channels[0]
        self.conv1 = ConvBNAct(3, c0, 3, 2)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages: list[nn.Module] = []
        inp = c0
        for reps, out in zip(stages_repeats, stages_out_channels[1:-1]):
            units = [ShuffleUnit(inp, out, 2)] + [ShuffleUnit(out, out, 1) for _ in range(reps - 1)]
            stages.append(nn.Sequential(*units))
            inp = out
        self.stages = nn.Sequential(*stages)
        self.conv5 = ConvBNAct(inp, stages_out_channels[-1], 1)
        self.fc = nn.Linear(stages_out_channels[-1], num_classes)
        _init_cnn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.conv1(x))
        x = self.conv5(self.stages(x))
        x = x.mean(dim=(2, 3))
        return self.fc(x)


def shufflenet_v2(stages_repeats: Sequence[int] = (4, 8, 4),
                  stages_out_channels: Sequence[int] = (24, 116, 232, 464, 1024),
                  num_classes: int = 1000) -> ShuffleNetV2:
    """ShuffleNetV2 x1.0 layout (2.3M params / 1000 classes)."""
    return ShuffleNetV2(stages_repeats, stages_out_channels, num_classes)


# --------------------------------------------------------------------------- SqueezeNet


class Fire(nn.Module):
    def __init__(self, inp: int, squeeze: int, e1: int, e3: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(inp, squeeze, 1)
        self.squeeze_act = nn.ReLU()
        self.expand1x1 = nn.Conv2d(squeeze, e1, 1)
        self.expand1x1_act = nn.ReLU()
        self.expand3x3 = nn.Conv2d(squeeze, e3, 3, padding=1)
        self.expand3x3_act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.squeeze_act(self.squeeze(x))
        return torch.cat((self.expand1x1_act(self.expand1x1(x)), self.expand3x3_act(self.expand3x3(x))), dim=1)


class SqueezeNet(nn.Module):
    """SqueezeNet 1.1 (no BatchNorm, as in the original); ``width`` scales every channel count."""

    def __init__(self, width: float = 1.0, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()

        def c(v: int) -> int:
            return max(4, int(v * width))

        def fire(inp: int, s: int, e: int) -> Fire:
            return Fire(c(inp), c(s), c(e), c(e))

        pool = nn.MaxPool2d  # every pool: kernel 3, stride 2, ceil_mode=True
        self.features = nn.Sequential(
            nn.Conv2d(3, c(64), 3, stride=2),
            nn.ReLU(),
            pool(3, 2, ceil_mode=True),
            fire(64, 16, 64),
            fire(128, 16, 64),
            pool(3, 2, ceil_mode=True),
            fire(128, 32, 128),
            fire(256, 32, 128),
            pool(3, 2, ceil_mode=True),
            fire(256, 48, 192),
            fire(384, 48, 192),
            fire(384, 64, 256),
            fire(512, 64, 256),
        )
        self.final_conv = nn.Conv2d(2 * c(256), num_classes, 1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), self.final_conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if m is self.final_conv:
                    nn.init.normal_(m.weight, 0.0, 0.01)
                else:
                    nn.init.kaiming_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x)).flatten(1)


def squeezenet(width: float = 1.0, num_classes: int = 1000) -> SqueezeNet:
    """SqueezeNet 1.1 (1.24M params at width 1.0 / 1000 classes)."""
    return SqueezeNet(width, num_classes)
