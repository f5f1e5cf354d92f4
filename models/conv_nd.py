"""Non-2D CNNs: a 3D-conv ResNet for video clips and a 1D-conv raw-waveform audio classifier."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["ResNet3D", "WavConv1d", "resnet3d", "wav_conv1d"]


# --------------------------------------------------------------------------- 3D ResNet (R3D-18 style)


class Block3d(nn.Module):
    def __init__(self, inp: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm3d(out)
        self.conv2 = nn.Conv3d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm3d(out)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv3d(inp, out, 1, stride, bias=False), nn.BatchNorm3d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + identity)


class ResNet3D(nn.Module):
    """[B, 3, T, H, W] clip -> [B, num_classes]; stem (3x7x7, spatial stride 2), 4 stages, global 3D pool."""

    def __init__(
        self,
        widths: Sequence[int] = (32, 64, 128, 256),
        blocks: Sequence[int] = (2, 2, 2, 2),
        num_classes: int = 400,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv3d(3, widths[0], (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False),
            nn.BatchNorm3d(widths[0]),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        inp = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            for j in range(n):
                layers.append(Block3d(inp, w, 2 if (i > 0 and j == 0) else 1))
                inp = w
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(inp, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv3d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm3d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(self.avgpool(x).flatten(1))


def resnet3d(widths: Sequence[int] = (32, 64, 128, 256), blocks: Sequence[int] = (2, 2, 2, 2),
             num_classes: int = 400) -> ResNet3D:
    """R3D-18 layout at half width (8.3M params / 400 Kinetics classes)."""
    return ResNet3D(widths, blocks, num_classes)


# --------------------------------------------------------------------------- 1D conv on raw audio

# (kernel, stride) per layer: the wav2vec 2.0 feature encoder (total stride 320, 20 ms frames at 16 kHz).
WAV2VEC_LAYERS = ((10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2))


class WavConv1d(nn.Module):
    """[B, 1, samples] waveform -> Conv1d-BN-GELU stack (strided) -> mean over time -> Linear."""

    def __init__(
        self,
        channels: int = 256,
        layers: Sequence[tuple[int, int]] = WAV2VEC_LAYERS,
        num_classes: int = 35,
    ) -> None:
        super().__init__()
        convs: list[nn.Module] = []
        inp = 1
        for k, s in layers:
            convs += [nn.Conv1d(inp, channels, k, s, bias=False), nn.BatchNorm1d(channels), nn.GELU()]
            inp = channels
        self.features = nn.Sequential(*convs)
        self.proj = nn.Linear(channels, channels)
        self.act = nn.GELU()
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv1d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, (1.0 / m.in_features) ** 0.5)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=2)  # global mean over time
        return self.fc(self.act(self.proj(x)))


def wav_conv1d(channels: int = 256, layers: Sequence[tuple[int, int]] = WAV2VEC_LAYERS,
               num_classes: int = 35) -> WavConv1d:
    return WavConv1d(channels, layers, num_classes)
