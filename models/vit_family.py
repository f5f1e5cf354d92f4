"""Vision transformers and relatives: ViT-B/16-style, MLP-Mixer, Swin-style window attention, MobileViT.

Attention is explicit (Linear / matmul / softmax, see ``models.transformer``).
Token reshapes use static sizes only (``unflatten``/``flatten``/``permute``;
``-1`` appears only in the leading batch position), so the batch dimension
stays dynamic in the exported ONNX graph.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mobile_cnn import ConvBNAct
from .transformer import Block, Mlp

__all__ = ["ViT", "MLPMixer", "SwinWindow", "MobileViT", "vit", "mlp_mixer", "swin_tiny_window", "mobilevit_like"]


def _init_transformer(model: nn.Module, std: float = 0.02) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# --------------------------------------------------------------------------- ViT


class ViT(nn.Module):
    """Conv patch embedding, class token, learned position embeddings, pre-norm blocks, head on the class token.

    The class token is prepended without a batch-sized expand: the token
    sequence is zero-padded by one position at the front (``F.pad``) and the
    class token is folded into position 0 of the position embedding, which is
    the same computation as ``cat(cls.expand(B, 1, C), x) + pos``.
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        dim: int = 384,
        depth: int = 6,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        n = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch_size, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n + 1, dim))
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        _init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, N, C]
        x = F.pad(x, (0, 0, 1, 0))  # empty slot for the class token: [B, N+1, C]
        pos = torch.cat((self.pos_embed[:, :1] + self.cls_token, self.pos_embed[:, 1:]), dim=1)
        x = self.norm(self.blocks(x + pos))
        return self.head(x[:, 0])


def vit(image_size: int = 224, patch_size: int = 16, dim: int = 384, depth: int = 6, num_heads: int = 6,
        mlp_ratio: float = 4.0, num_classes: int = 1000) -> ViT:
    return ViT(image_size, patch_size, dim, depth, num_heads, mlp_ratio, num_classes)


# --------------------------------------------------------------------------- MLP-Mixer


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.token_mlp = Mlp(tokens, token_hidden)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.channel_mlp = Mlp(dim, channel_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)  # mix along tokens
        return x + self.channel_mlp(self.norm2(x))  # mix along channels


class MLPMixer(nn.Module):
    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        dim: int = 512,
        depth: int = 8,
        token_hidden: int = 256,
        channel_hidden: int = 2048,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        tokens = (image_size // patch_size) ** 2
        self.stem = nn.Conv2d(3, dim, patch_size, patch_size)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, dim, token_hidden, channel_hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x)).mean(dim=1)
        return self.head(x)


def mlp_mixer(image_size: int = 224, patch_size: int = 16, dim: int = 512, depth: int = 8, token_hidden: int = 256,
              channel_hidden: int = 2048, num_classes: int = 1000) -> MLPMixer:
    """Mixer-S/16 layout (18.5M params / 1000 classes)."""
    return MLPMixer(image_size, patch_size, dim, depth, token_hidden, channel_hidden, num_classes)


# --------------------------------------------------------------------------- Swin (window attention)


def window_partition(x: torch.Tensor, ws: int, res: int) -> torch.Tensor:
    """[B, R, R, C] -> [B * (R/ws)^2, ws*ws, C] (R = res, static)."""
    r = res // ws
    x = x.unflatten(1, (r, ws)).unflatten(3, (r, ws))  # [B, r, ws, r, ws, C]
    return x.permute(0, 1, 3, 2, 4, 5).flatten(3, 4).flatten(0, 2)


def window_reverse(w: torch.Tensor, ws: int, res: int) -> torch.Tensor:
    """[B * (R/ws)^2, ws*ws, C] -> [B, R, R, C]."""
    r = res // ws
    w = w.unflatten(1, (ws, ws)).unflatten(0, (-1, r, r))  # [B, r, r, ws, ws, C]
    return w.permute(0, 1, 3, 2, 4, 5).flatten(3, 4).flatten(1, 2)


class WindowAttention(nn.Module):
    """Multi-head attention inside ws x ws windows with a relative position bias table."""

    def __init__(self, dim: int, num_heads: int, ws: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.n = ws * ws
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rel_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, num_heads))
        nn.init.trunc_normal_(self.rel_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)  # [2, N]
        rel = coords[:, :, None] - coords[:, None, :] + (ws - 1)  # [2, N, N]
        self.register_buffer("rel_index", (rel[0] * (2 * ws - 1) + rel[1]).flatten(), persistent=False)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], num_windows: int) -> torch.Tensor:
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [Bw, H, N, D]
        attn = torch.matmul(q * self.scale, k.transpose(-2, -1))
        bias = self.rel_table[self.rel_index].unflatten(0, (self.n, self.n)).permute(2, 0, 1)  # [H, N, N]
        attn = attn + bias
        if mask is not None:  # mask: [nW, N, N]; windows of one image are consecutive
            attn = (attn.unflatten(0, (-1, num_windows)) + mask[:, None]).flatten(0, 1)
        out = torch.matmul(torch.softmax(attn, dim=-1), v)
        return self.proj(out.transpose(1, 2).flatten(2))


class SwinBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, res: int, ws: int, shift: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        if res <= ws:
            ws, shift = res, 0
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, ws)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        mask = None
        if shift:
            img = torch.zeros(1, res, res, 1)
            cnt = 0
            for hs in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for wsl in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img[:, hs, wsl, :] = cnt
                    cnt += 1
            mw = window_partition(img, ws, res).squeeze(-1)  # [nW, N]
            diff = mw[:, None, :] - mw[:, :, None]
            mask = torch.where(diff != 0, torch.tensor(-100.0), torch.tensor(0.0))
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x).unflatten(1, (self.res, self.res))  # [B, R, R, C]
        if self.shift:
            h = torch.roll(h, shifts=(-self.shift, -self.shift), dims=(1, 2))
        h = self.attn(window_partition(h, self.ws, self.res), self.attn_mask, (self.res // self.ws) ** 2)
        h = window_reverse(h, self.ws, self.res)
        if self.shift:
            h = torch.roll(h, shifts=(self.shift, self.shift), dims=(1, 2))
        x = x + h.flatten(1, 2)
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """[B, R*R, C] -> gather 2x2 neighbours -> LayerNorm(4C) -> Linear -> [B, R*R/4, 2C]."""

    def __init__(self, dim: int, res: int) -> None:
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unflatten(1, (self.res, self.res))
        x = torch.cat((x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]), dim=-1)
        return self.reduction(self.norm(x.flatten(1, 2)))


class SwinWindow(nn.Module):
    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 4,
        dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        heads: Sequence[int] = (3, 6, 12, 24),
        window: int = 7,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch_size, patch_size)
        self.embed_norm = nn.LayerNorm(dim)
        res = image_size // patch_size
        layers: list[nn.Module] = []
        for i, (d, h) in enumerate(zip(depths, heads)):
            if i > 0:
                layers.append(PatchMerging(dim, res))
                dim, res = dim * 2, res // 2
            for j in range(d):
                layers.append(SwinBlock(dim, h, res, window, shift=(window // 2) if j % 2 else 0))
        self.layers = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        _init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(x).flatten(2).transpose(1, 2))  # [B, R*R, C]
        x = self.norm(self.layers(x)).mean(dim=1)
        return self.head(x)


def swin_tiny_window(image_size: int = 224, patch_size: int = 4, dim: int = 96, depths: Sequence[int] = (2, 2, 6, 2),
                     heads: Sequence[int] = (3, 6, 12, 24), window: int = 7, num_classes: int = 1000) -> SwinWindow:
    """Swin-T layout (28.3M params / 1000 classes), shifted windows in every second block."""
    return SwinWindow(image_size, patch_size, dim, depths, heads, window, num_classes)


# --------------------------------------------------------------------------- MobileViT


class MV2(nn.Module):
    """MobileNetV2 inverted residual with SiLU (as in MobileViT)."""

    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        self.block = nn.Sequential(
            ConvBNAct(inp, hidden, 1, act=nn.SiLU),
            ConvBNAct(hidden, hidden, 3, stride, groups=hidden, act=nn.SiLU),
            ConvBNAct(hidden, out, 1, act=None),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_res else y


class MobileViTBlock(nn.Module):
    """Local 3x3 conv -> 1x1 to dim -> unfold 2x2 patches -> transformer -> fold -> 1x1 -> fuse with input."""

    def __init__(self, ch: int, dim: int, depth: int, res: int, patch: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.p, self.n = patch, res // patch
        self.local = nn.Sequential(ConvBNAct(ch, ch, 3, act=nn.SiLU), nn.Conv2d(ch, dim, 1, bias=False))
        self.transformer = nn.Sequential(*[Block(dim, heads, 2.0) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.proj = ConvBNAct(dim, ch, 1, act=nn.SiLU)
        self.fuse = ConvBNAct(2 * ch, ch, 3, act=nn.SiLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, n = self.p, self.n
        y = self.local(x)  # [B, d, H, W]
        # unfold: [B, d, n, p, n, p] -> [B, p, p, n, n, d] -> [B*p*p, n*n, d]
        y = y.unflatten(2, (n, p)).unflatten(4, (n, p)).permute(0, 3, 5, 2, 4, 1).flatten(3, 4).flatten(0, 2)
        y = self.norm(self.transformer(y))
        # fold: [B*p*p, n*n, d] -> [B, p, p, n, n, d] -> [B, d, n, p, n, p] -> [B, d, H, W]
        y = y.unflatten(0, (-1, p, p)).unflatten(3, (n, n)).permute(0, 5, 3, 1, 4, 2).flatten(4, 5).flatten(2, 3)
        return self.fuse(torch.cat((x, self.proj(y)), dim=1))


class MobileViT(nn.Module):
    """MobileViT-XXS layout by default: MV2 stages, then three (MV2 stride 2 + MobileViT block) stages."""

    def __init__(
        self,
        image_size: int = 256,
        stem: int = 16,
        mv2: Sequence[tuple[int, int]] = ((16, 1), (24, 2), (24, 1), (24, 1)),
        stages: Sequence[tuple[int, int, int]] = ((48, 64, 2), (64, 80, 4), (80, 96, 3)),
        last: int = 320,
        expand: int = 2,
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvBNAct(3, stem, 3, 2, act=nn.SiLU)]
        res, inp = image_size // 2, stem
        for c, s in mv2:
            layers.append(MV2(inp, c, s, expand))
            inp, res = c, res // s
        for c, d, depth in stages:
            res //= 2
            layers += [MV2(inp, c, 2, expand), MobileViTBlock(c, d, depth, res)]
            inp = c
        layers.append(ConvBNAct(inp, last, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(last, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean(dim=(2, 3)))


def mobilevit_like(image_size: int = 256, stem: int = 16,
                   mv2: Sequence[tuple[int, int]] = ((16, 1), (24, 2), (24, 1), (24, 1)),
                   stages: Sequence[tuple[int, int, int]] = ((48, 64, 2), (64, 80, 4), (80, 96, 3)),
                   last: int = 320, num_classes: int = 1000) -> MobileViT:
    return MobileViT(image_size, stem, mv2, stages, last, 2, num_classes)
