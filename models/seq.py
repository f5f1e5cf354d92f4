"""Sequence models: a BERT-style encoder, a GPT-style decoder (RoPE, RMSNorm, SwiGLU), LSTM and GRU nets.

Token-id and mask inputs are int64 ``[B, seq]``; the sequence length is a
construction-time constant, so position ids, rotary tables and the causal
mask are registered buffers sliced with static bounds.  Masks use a large
finite negative number (-1e4), never -inf, so a fully masked row stays finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BertEncoder", "GPTDecoder", "LSTMClassifier", "GRUTagger", "bert", "gpt", "lstm_classifier", "gru_tagger"]

NEG = -1e4  # additive mask value (finite in fp16)


def _init_transformer(model: nn.Module, std: float = 0.02) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.trunc_normal_(m.weight, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class SelfAttention(nn.Module):
    """Explicit multi-head attention on [B, S, C] with an additive [B or 1, 1, S|1, S] mask."""

    def __init__(self, dim: int, num_heads: int, bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # [B, H, S, D] each

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q * self.scale, k.transpose(-2, -1)) + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.heads(x), mask)


# --------------------------------------------------------------------------- BERT


class BertLayer(nn.Module):
    """Post-LayerNorm encoder layer: LN(x + attn(x)), LN(x + FFN(x))."""

    def __init__(self, dim: int, num_heads: int, ffn: int) -> None:
        super().__init__()
        self.attn = SelfAttention(dim, num_heads)
        self.norm1 = nn.LayerNorm(dim, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, mask))
        return self.norm2(x + self.ffn(x))


class BertEncoder(nn.Module):
    """(input_ids [B,S] int64, attention_mask [B,S] int64; 0 = padding) -> (last_hidden_state [B,S,C], pooled [B,C])."""

    def __init__(
        self,
        vocab: int = 1000,
        seq_len: int = 128,
        dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        ffn: int = 1024,
        max_positions: int = 512,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Embedding(max_positions, dim)
        self.register_buffer("position_ids", torch.arange(max_positions).unsqueeze(0), persistent=False)
        self.embed_norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, num_heads, ffn) for _ in range(depth))
        self.pooler = nn.Linear(dim, dim)
        _init_transformer(self)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions of this call's length (at most max_positions), so an
        # export with a dynamic sequence axis serves every length
        pos = self.position_embeddings(self.position_ids[:, : input_ids.shape[1]])  # [1, S, C]
        x = self.embed_norm(self.word_embeddings(input_ids) + pos)
        keep = attention_mask > 0
        mask = (~keep).to(x.dtype).mul(NEG)[:, None, None, :]  # [B, 1, 1, S]
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return x, pooled


def bert(vocab: int = 1000, seq_len: int = 128, dim: int = 256, depth: int = 4, num_heads: int = 4,
         ffn: int = 1024) -> BertEncoder:
    return BertEncoder(vocab, seq_len, dim, depth, num_heads, ffn)


# --------------------------------------------------------------------------- GPT


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class CausalRoPEAttention(SelfAttention):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return self.attend(q, k, v, mask)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = CausalRoPEAttention(dim, num_heads, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPTDecoder(nn.Module):
    """input_ids [B,S] int64 -> logits [B,S,vocab]; pre-RMSNorm blocks, RoPE, causal mask, tied LM head."""

    def __init__(
        self,
        vocab: int = 1000,
        seq_len: int = 128,
        dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        hidden: int = 704,
        max_positions: int = 512,
        rope_base: float = 10000.0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        head_dim = dim // num_heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(GPTBlock(dim, num_heads, hidden) for _ in range(depth))
        self.norm = RMSNorm(dim)
        inv_freq = 1.0 / rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [P, D] (rotate-half layout)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        causal = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)
        _init_transformer(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = self.seq_len
        x = self.tok_embeddings(input_ids)
        cos, sin = self.rope_cos[:s].to(x.dtype), self.rope_sin[:s].to(x.dtype)
        mask = torch.where(self.causal[:s, :s], 0.0, NEG).to(x.dtype)  # [S, S], broadcast over B, H
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return F.linear(self.norm(x), self.tok_embeddings.weight)  # tied LM head


def gpt(vocab: int = 1000, seq_len: int = 128, dim: int = 256, depth: int = 4, num_heads: int = 4,
        hidden: int = 704) -> GPTDecoder:
    return GPTDecoder(vocab, seq_len, dim, depth, num_heads, hidden)


# --------------------------------------------------------------------------- RNNs


class LSTMClassifier(nn.Module):
    """input_ids [B,S] int64 -> Embedding -> 2-layer LSTM (batch_first) -> Linear on the last step."""

    def __init__(self, vocab: int = 1000, embed: int = 128, hidden: int = 256, layers: int = 2,
                 num_classes: int = 5) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)
        nn.init.normal_(self.embedding.weight, 0.0, 0.1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(input_ids))
        return self.fc(out[:, -1])


def lstm_classifier(vocab: int = 1000, embed: int = 128, hidden: int = 256, layers: int = 2,
                    num_classes: int = 5) -> LSTMClassifier:
    return LSTMClassifier(vocab, embed, hidden, layers, num_classes)


class GRUTagger(nn.Module):
    """features [B,S,F] float -> 2-layer bidirectional GRU (batch_first) -> per-step Linear -> [B,S,tags]."""

    def __init__(self, features: int = 40, hidden: int = 128, layers: int = 2, num_tags: int = 12) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=layers, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, num_tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.fc(out)


def gru_tagger(features: int = 40, hidden: int = 128, layers: int = 2, num_tags: int = 12) -> GRUTagger:
    return GRUTagger(features, hidden, layers, num_tags)
