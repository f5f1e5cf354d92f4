"""Classification CNNs: ResNeXt, DenseNet, ConvNeXt, a GroupNorm/InstanceNorm net, a two-input/two-output net.

Plain-torch definitions with random weights; every stage table is a
constructor argument so the corpus can build a narrow, shallow variant of the
same architecture for fast tests.  Channel-wise LayerNorm is done as
permute(NHWC) -> nn.LayerNorm -> permute(NCHW), never with a batch-sized reshape.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .mobile_cnn import ConvBNAct

__all__ = [
    "ResNeXt",
    "DenseNet",
    "ConvNeXt",
    "GroupNormNet",
    "MultiIONet",
    "resnext",
    "densenet",
    "convnext",
    "groupnorm_net",
    "multi_io",
]


def _kaiming(model: nn.Module, mode: str = "fan_out") -> None:
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, mode=mode, nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) or (isinstance(m, nn.InstanceNorm2d) and m.affine):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------- ResNeXt


class XBottleneck(nn.Module):
    """ResNeXt bottleneck: 1x1 -> grouped 3x3 (stride here, v1.5) -> 1x1 (x4), residual."""

    def __init__(self, inp: int, planes: int, stride: int, groups: int, base_width: int) -> None:
        super().__init__()
        width = int(planes * base_width / 64) * groups
        out = planes * 4
        self.conv1 = ConvBNAct(inp, width, 1)
        self.conv2 = ConvBNAct(width, width, 3, stride, groups=groups)
        self.conv3 = ConvBNAct(width, out, 1, act=None)
        self.downsample = ConvBNAct(inp, out, 1, stride, act=None) if stride != 1 or inp != out else None
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(self.conv3(self.conv2(self.conv1(x))) + identity)


class ResNeXt(nn.Module):
    def __init__(
        self,
        layers: Sequence[int] = (3, 4, 6, 3),
        planes: Sequence[int] = (64, 128, 256, 512),
        groups: int = 32,
        base_width: int = 4,
        stem: int = 64,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, stem, 7, 2), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        inp = stem
        for i, (n, p) in enumerate(zip(layers, planes)):
            for j in range(n):
                blocks.append(XBottleneck(inp, p, 2 if (j == 0 and i > 0) else 1, groups, base_width))
                inp = p * 4
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inp, num_classes)
        _kaiming(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(self.avgpool(x).flatten(1))


def resnext(layers: Sequence[int] = (3, 4, 6, 3), planes: Sequence[int] = (64, 128, 256, 512), groups: int = 32,
            base_width: int = 4, stem: int = 64, num_classes: int = 1000) -> ResNeXt:
    """ResNeXt-50 32x4d layout (25.0M params / 1000 classes)."""
    return ResNeXt(layers, planes, groups, base_width, stem, num_classes)


# --------------------------------------------------------------------------- DenseNet


class DenseLayer(nn.Module):
    """BN-ReLU-Conv1x1 (bn_size * growth) -> BN-ReLU-Conv3x3 (growth)."""

    def __init__(self, inp: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(inp)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(inp, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, dim=1)
        return self.conv2(self.relu2(self.norm2(self.conv1(self.relu1(self.norm1(x))))))


class DenseBlock(nn.ModuleList):
    def __init__(self, n: int, inp: int, growth: int, bn_size: int) -> None:
        super().__init__([DenseLayer(inp + i * growth, growth, bn_size) for i in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self:
            features.append(layer(features))
        return torch.cat(features, dim=1)


class Transition(nn.Sequential):
    """BN-ReLU-Conv1x1 (halve channels) -> AvgPool 2x2."""

    def __init__(self, inp: int, out: int) -> None:
        super().__init__(nn.BatchNorm2d(inp), nn.ReLU(), nn.Conv2d(inp, out, 1, bias=False), nn.AvgPool2d(2, 2))


class DenseNet(nn.Module):
    def __init__(
        self,
        growth: int = 32,
        blocks: Sequence[int] = (6, 12, 24, 16),
        init_features: int = 64,
        bn_size: int = 4,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, init_features, 7, 2, 3, bias=False),
            nn.BatchNorm2d(init_features),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        ]
        c = init_features
        for i, n in enumerate(blocks):
            layers.append(DenseBlock(n, c, growth, bn_size))
            c += n * growth
            if i != len(blocks) - 1:
                layers.append(Transition(c, c // 2))
                c //= 2
        layers += [nn.BatchNorm2d(c), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c, num_classes)
        # fan_in, as torchvision's DenseNet: the 1x1 bottleneck convs have fan_in >> fan_out,
        # and fan_out scaling would blow activations up by ~fan_in/fan_out per layer.
        _kaiming(self, mode="fan_in")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def densenet(growth: int = 32, blocks: Sequence[int] = (6, 12, 24, 16), init_features: int = 64,
             bn_size: int = 4, num_classes: int = 1000) -> DenseNet:
    """DenseNet-121 layout (8.0M params / 1000 classes)."""
    return DenseNet(growth, blocks, init_features, bn_size, num_classes)


# --------------------------------------------------------------------------- ConvNeXt


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channel dim of an NCHW tensor (permute to NHWC and back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float = 0.1) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # NHWC
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(
        self,
        depths: Sequence[int] = (3, 3, 9, 3),
        dims: Sequence[int] = (96, 192, 384, 768),
        num_classes: int = 1000,
        layer_scale: float = 0.1,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6)]
        for i, (d, c) in enumerate(zip(depths, dims)):
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], c, 2, 2)]
            layers += [ConvNeXtBlock(c, layer_scale) for _ in range(d)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))
        return self.head(self.norm(x))


def convnext(depths: Sequence[int] = (3, 3, 9, 3), dims: Sequence[int] = (96, 192, 384, 768),
             num_classes: int = 1000) -> ConvNeXt:
    """ConvNeXt-T layout (28.6M params / 1000 classes), layer scale 0.1."""
    return ConvNeXt(depths, dims, num_classes)


# --------------------------------------------------------------------------- GroupNorm net


class GNResBlock(nn.Module):
    """Diffusion-UNet residual block: GN-SiLU-Conv3x3 -> GN-SiLU-Conv3x3, 1x1 skip if channels change."""

    def __init__(self, inp: int, out: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, inp)
        self.act1 = nn.SiLU()
        self.conv1 = nn.Conv2d(inp, out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out)
        self.act2 = nn.SiLU()
        self.conv2 = nn.Conv2d(out, out, 3, padding=1)
        self.skip = nn.Conv2d(inp, out, 1) if inp != out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act1(self.norm1(x)))
        h = self.conv2(self.act2(self.norm2(h)))
        return (self.skip(x) + h) * 0.7071067811865476


class GroupNormNet(nn.Module):
    """InstanceNorm2d(affine) + ReLU stem, GroupNorm residual stages with strided downsampling, GN head."""

    def __init__(
        self,
        channels: Sequence[int] = (64, 128, 256, 256),
        blocks_per_stage: int = 2,
        groups: int = 32,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        c0 = channels[0]
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 3, padding=1), nn.InstanceNorm2d(c0, affine=True), nn.ReLU())
        layers: list[nn.Module] = []
        inp = c0
        for i, c in enumerate(channels):
            if i > 0:
                layers.append(nn.Conv2d(inp, inp, 3, stride=2, padding=1))  # downsample
            for _ in range(blocks_per_stage):
                layers.append(GNResBlock(inp, c, groups))
                inp = c
        self.stages = nn.Sequential(*layers)
        self.head_norm = nn.GroupNorm(groups, inp)
        self.head_act = nn.SiLU()
        self.fc = nn.Linear(inp, num_classes)
        _kaiming(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        x = self.head_act(self.head_norm(x)).mean(dim=(2, 3))
        return self.fc(x)


def groupnorm_net(channels: Sequence[int] = (64, 128, 256, 256), blocks_per_stage: int = 2, groups: int = 32,
                  num_classes: int = 1000) -> GroupNormNet:
    return GroupNormNet(channels, blocks_per_stage, groups, num_classes)


# --------------------------------------------------------------------------- two inputs, two outputs


class MultiIONet(nn.Module):
    """(image [3,H,W], metadata [meta_dim]) -> (class logits, box [4] in (0, 1)).

    A Conv-BN-ReLU backbone and a metadata MLP are fused by concatenation; two
    heads share the fused feature.
    """

    def __init__(
        self,
        channels: Sequence[int] = (32, 64, 128, 256, 512),
        meta_dim: int = 16,
        meta_hidden: int = 64,
        fused: int = 256,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        inp = 3
        for c in channels:
            layers += [ConvBNAct(inp, c, 3, 2), ConvBNAct(c, c, 3, 1)]
            inp = c
        self.backbone = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.meta_mlp = nn.Sequential(nn.Linear(meta_dim, meta_hidden), nn.ReLU(), nn.LayerNorm(meta_hidden))
        self.fuse = nn.Sequential(nn.Linear(inp + meta_hidden, fused), nn.ReLU())
        self.cls_head = nn.Linear(fused, num_classes)
        self.box_head = nn.Sequential(nn.Linear(fused, fused // 2), nn.ReLU(), nn.Linear(fused // 2, 4), nn.Sigmoid())
        _kaiming(self)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, (1.0 / m.in_features) ** 0.5)

    def forward(self, image: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.avgpool(self.backbone(image)).flatten(1)
        h = self.fuse(torch.cat((f, self.meta_mlp(meta)), dim=1))
        return self.cls_head(h), self.box_head(h)


def multi_io(channels: Sequence[int] = (32, 64, 128, 256, 512), meta_dim: int = 16, meta_hidden: int = 64,
             fused: int = 256, num_classes: int = 1000) -> MultiIONet:
    return MultiIONet(channels, meta_dim, meta_hidden, fused, num_classes)
