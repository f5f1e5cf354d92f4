"""Dense-prediction CNNs: DeepLabV3-style ASPP segmentation, U-Net, ESPCN super-resolution.

Every resize is static (a fixed ``scale_factor`` or a ``size`` computed from
the configured image size at construction), so the ONNX graph carries no
shape arithmetic and the batch dimension stays dynamic.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mobile_cnn import ConvBNAct

__all__ = ["DeepLabASPP", "UNet", "ESPCN", "deeplab_aspp", "unet", "espcn"]


def _kaiming(model: nn.Module, classifier: nn.Conv2d) -> None:
    """Kaiming (fan_out) for the body; the per-pixel classifier gets unit gain on its fan_in so
    the logits stay O(1) (fan_out scaling of a 1x1 conv to a few classes would amplify them)."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    nn.init.kaiming_normal_(classifier.weight, mode="fan_in", nonlinearity="linear")


# --------------------------------------------------------------------------- DeepLab (ASPP)


class DilatedBlock(nn.Module):
    """ResNet basic block whose 3x3 convs may be dilated (stride 1 in dilated stages)."""

    def __init__(self, inp: int, out: int, stride: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, dilation, dilation=dilation, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, dilation, dilation=dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        self.downsample = ConvBNAct(inp, out, 1, stride, act=None) if stride != 1 or inp != out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + identity)


class ASPP(nn.Module):
    """1x1 branch, three dilated 3x3 branches, image-pooling branch -> concat -> 1x1 projection."""

    def __init__(self, inp: int, out: int, rates: Sequence[int], feat_size: int) -> None:
        super().__init__()
        self.feat_size = feat_size
        self.branches = nn.ModuleList([ConvBNAct(inp, out, 1)])
        for r in rates:
            self.branches.append(
                nn.Sequential(nn.Conv2d(inp, out, 3, padding=r, dilation=r, bias=False), nn.BatchNorm2d(out), nn.ReLU())
            )
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), ConvBNAct(inp, out, 1))
        self.project = nn.Sequential(ConvBNAct(out * (len(rates) + 2), out, 1), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [b(x) for b in self.branches]
        size = (self.feat_size, self.feat_size)
        pooled = F.interpolate(self.pool(x), size=size, mode="bilinear", align_corners=False)  # broadcast 1x1
        outs.append(pooled)
        return self.project(torch.cat(outs, dim=1))


class DeepLabASPP(nn.Module):
    """Dilated ResNet-18-style backbone (output stride 16 or 8) + ASPP head + bilinear upsampling.

    [B, 3, S, S] -> [B, num_classes, S, S] per-pixel logits.
    """

    def __init__(
        self,
        image_size: int = 256,
        widths: Sequence[int] = (64, 128, 256, 512),
        blocks: Sequence[int] = (2, 2, 2, 2),
        output_stride: int = 16,
        aspp_channels: int = 256,
        rates: Sequence[int] = (6, 12, 18),
        num_classes: int = 21,
    ) -> None:
        super().__init__()
        if output_stride not in (8, 16) or image_size % output_stride:
            raise ValueError(f"output_stride {output_stride} must be 8 or 16 and divide image_size {image_size}")
        self.output_stride = output_stride
        self.stem = nn.Sequential(ConvBNAct(3, widths[0], 7, 2), nn.MaxPool2d(3, 2, 1))  # /4
        # stage strides: /4, /8, then /16 (or dilation 2 for OS8), then dilation.
        strides = (1, 2, 2 if output_stride == 16 else 1, 1)
        dilations = (1, 1, 1 if output_stride == 16 else 2, 2 if output_stride == 16 else 4)
        layers: list[nn.Module] = []
        inp = widths[0]
        for w, n, s, d in zip(widths, blocks, strides, dilations):
            for j in range(n):
                layers.append(DilatedBlock(inp, w, s if j == 0 else 1, d))
                inp = w
        self.backbone = nn.Sequential(*layers)
        self.aspp = ASPP(inp, aspp_channels, rates, image_size // output_stride)
        self.head = nn.Sequential(ConvBNAct(aspp_channels, aspp_channels, 3), nn.Conv2d(aspp_channels, num_classes, 1))
        _kaiming(self, self.head[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.aspp(self.backbone(self.stem(x))))
        return F.interpolate(y, scale_factor=float(self.output_stride), mode="bilinear", align_corners=False)


def deeplab_aspp(image_size: int = 256, widths: Sequence[int] = (64, 128, 256, 512),
                 blocks: Sequence[int] = (2, 2, 2, 2), output_stride: int = 16, aspp_channels: int = 256,
                 num_classes: int = 21) -> DeepLabASPP:
    return DeepLabASPP(image_size, widths, blocks, output_stride, aspp_channels, (6, 12, 18), num_classes)


# --------------------------------------------------------------------------- U-Net


class DoubleConv(nn.Sequential):
    def __init__(self, inp: int, out: int) -> None:
        super().__init__(ConvBNAct(inp, out, 3), ConvBNAct(out, out, 3))


class Up(nn.Module):
    """Upsample x2 (ConvTranspose2d, or nearest Upsample + 1x1 conv), concat the skip, DoubleConv."""

    def __init__(self, inp: int, out: int, transpose: bool) -> None:
        super().__init__()
        if transpose:
            self.up = nn.ConvTranspose2d(inp, out, 2, stride=2)
        else:
            self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(inp, out, 1))
        self.conv = DoubleConv(2 * out, out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat((skip, self.up(x)), dim=1))


class UNet(nn.Module):
    """Encoder (DoubleConv + MaxPool) / decoder with skip concatenations; [B,3,S,S] -> [B,classes,S,S].

    Decoder levels alternate ConvTranspose2d (deepest first) and nearest Upsample.
    """

    def __init__(self, widths: Sequence[int] = (32, 64, 128, 256, 512), in_ch: int = 3, num_classes: int = 3) -> None:
        super().__init__()
        self.inc = DoubleConv(in_ch, widths[0])
        self.downs = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), DoubleConv(widths[i], widths[i + 1])) for i in range(len(widths) - 1)
        )
        rev = list(reversed(widths))
        self.ups = nn.ModuleList(Up(rev[i], rev[i + 1], transpose=(i % 2 == 0)) for i in range(len(rev) - 1))
        self.outc = nn.Conv2d(widths[0], num_classes, 1)
        _kaiming(self, self.outc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = [x]
        for down in self.downs:
            x = down(x)
            skips.append(x)
        skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)


def unet(widths: Sequence[int] = (32, 64, 128, 256, 512), in_ch: int = 3, num_classes: int = 3) -> UNet:
    return UNet(widths, in_ch, num_classes)


# --------------------------------------------------------------------------- ESPCN


class ESPCN(nn.Module):
    """Conv5x5-tanh -> Conv3x3-tanh -> Conv3x3 (C * r^2) -> PixelShuffle(r): [B,C,H,W] -> [B,C,rH,rW]."""

    def __init__(self, channels: int = 3, upscale: int = 3, f1: int = 64, f2: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, f1, 5, padding=2)
        self.act1 = nn.Tanh()
        self.conv2 = nn.Conv2d(f1, f2, 3, padding=1)
        self.act2 = nn.Tanh()
        self.conv3 = nn.Conv2d(f2, channels * upscale**2, 3, padding=1)
        self.shuffle = nn.PixelShuffle(upscale)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.shuffle(self.conv3(x))


def espcn(channels: int = 3, upscale: int = 3, f1: int = 64, f2: int = 32) -> ESPCN:
    return ESPCN(channels, upscale, f1, f2)
