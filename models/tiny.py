"""Very small models for fast tests."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TinyCNN", "TinyMLP", "tiny_cnn", "tiny_mlp"]


class TinyCNN(nn.Module):
    """Conv-BN-ReLU x2 -> global avgpool -> Linear; [N, 3, 16, 16] -> [N, 10]."""

    def __init__(self, in_chans: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_chans, 16, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.relu2 = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


class TinyMLP(nn.Module):
    """Linear-ReLU-Linear-ReLU-Linear; [N, 64] -> [N, 10]."""

    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.fc1(x))
        x = self.relu2(self.fc2(x))
        return self.fc3(x)


def tiny_cnn(num_classes: int = 10) -> TinyCNN:
    return TinyCNN(num_classes=num_classes)


def tiny_mlp(num_classes: int = 10) -> TinyMLP:
    return TinyMLP(num_classes=num_classes)
