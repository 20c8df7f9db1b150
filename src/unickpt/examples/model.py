"""A small Llama-style decoder: RMSNorm, rotary attention with grouped-query heads,
SwiGLU MLP, untied embedding and output.

Layers live in a ModuleDict keyed by their global index, so a pipeline stage that keeps
only some layers still names them globally (``layers.5`` on any stage): checkpoints of
pipelined and non-pipelined jobs share names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    """Model size."""

    dim: int = 64
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 128
    seq: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (Llama's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, shape (seq, head_dim // 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads and rotary embeddings."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.head_dim = a.dim // a.heads
        self.rep = a.heads // a.kv_heads
        self.wq = nn.Linear(a.dim, a.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # head counts come from the local shapes, so tensor-parallel shards work unchanged
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(self.rep, dim=2)
        v = v.repeat_interleave(self.rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm transformer layer: attention then feed-forward, each residual."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a.dim, 4 * a.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it once trimmed by :func:`keep_stage`."""

    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.args = a
        self.tok_embeddings: nn.Module | None = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.layers)})
        self.norm: nn.Module | None = RMSNorm(a.dim, a.norm_eps)
        self.output: nn.Module | None = nn.Linear(a.dim, a.vocab, bias=False)
        cos, sin = rope_tables(a.dim // a.heads, a.seq, a.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        s = h.shape[1]
        for layer in self.layers.values():
            h = layer(h, self.rope_cos[:s], self.rope_sin[:s])
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def keep_stage(model: Transformer, stage: int, stages: int) -> Transformer:
    """Trim ``model`` in place to pipeline stage ``stage`` of ``stages`` (contiguous layers)."""
    n = model.args.layers
    if n % stages:
        raise ValueError(f"{n} layers do not split into {stages} pipeline stages")
    per = n // stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = None
        model.output = None
    return model
