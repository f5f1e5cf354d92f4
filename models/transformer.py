"""A small ViT-style transformer encoder classifier for 3x32x32 images.

Attention is written out explicitly with Linear / matmul / softmax so that the
TorchScript ONNX exporter produces plain MatMul/Softmax/LayerNormalization
nodes (no nn.MultiheadAttention fast path).  All reshapes use static sizes
(``unflatten``/``flatten``/``transpose``) so the batch dimension stays dynamic
in the exported graph.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Attention", "Mlp", "Block", "TinyViT", "tiny_vit"]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, N, C]
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # [B, N, 3, H, D]
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, H, N, D]
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.matmul(q * self.scale, k.transpose(-2, -1))  # [B, H, N, N]
        attn = torch.softmax(attn, dim=-1)
        out = torch.matmul(attn, v)  # [B, H, N, D]
        out = out.transpose(1, 2).flatten(2)  # [B, N, C]
        return self.proj(out)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class TinyViT(nn.Module):
    """Patch-embedding ViT: [N, 3, 32, 32] -> [N, num_classes] logits.

    Patch size 4 gives 8x8 = 64 tokens; classification uses the mean token
    (no class token) after a final LayerNorm.
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        dim: int = 128,
        depth: int = 3,
        num_heads: int = 4,
        mlp_ratio: float = 2.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size != 0:
            raise ValueError(f"image_size {image_size} is not divisible by patch_size {patch_size}")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, dim))
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # [B, C, H/p, W/p]
        x = x.flatten(2).transpose(1, 2)  # [B, N, C]
        x = x + self.pos_embed
        x = self.blocks(x)
        x = self.norm(x)
        x = x.mean(dim=1)
        return self.head(x)


def tiny_vit(num_classes: int = 10) -> TinyViT:
    """3-layer, dim-128, 4-head ViT on 3x32x32 input with 4x4 patches."""
    return TinyViT(num_classes=num_classes)
