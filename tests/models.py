"""The small models the tests share (the zoo's HF models are built in autopar.zoo).

- :func:`mlp`: ``fc2(relu(fc1(x)))`` from ``width`` back to ``width`` (autopar.zoo.MLP);
- :class:`Residual` / :class:`ResidualStack`: ``x + tanh(fc(x)) * scale`` blocks in a ModuleList (repeated
  layers: stamping, pipeline stages);
- :class:`TiedBatchNorm`: an embedding tied to the output head and a BatchNorm whose running statistics
  change (buffers that training updates, a parameter under two names);
- :class:`TinyTransformer`: embedding, one attention + MLP block, head, cross-entropy loss;
- :func:`meta_gpt2` / :func:`meta_llama`: 4-layer GPT-2 and LLaMA shapes on the meta device with their
  inputs by name (stage memory and recompute fidelity against ``verify``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from autopar import zoo
from autopar.zoo import MLP


def mlp(width: int = 8, hidden: int = 16) -> MLP:
    """The two-layer MLP from ``width`` to ``width`` through ``hidden`` (parameters fc1.*, fc2.*)."""
    return MLP(width, hidden, width)


class Residual(nn.Module):
    def __init__(self, width: int = 8, scale: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.scale


class ResidualStack(nn.Module):
    """``depth`` residual blocks (``blocks.i``), then an optional linear ``head``."""

    def __init__(self, depth: int = 4, width: int = 8, head: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, head) if head else None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


class BufferedStack(nn.Module):
    """Residual blocks each mixing through a fixed buffer (``blocks.i.mix``), after a position table
    buffer read by the first op and beside a buffer nothing reads (``unread``); a linear head."""

    def __init__(self, depth: int = 4, width: int = 128, positions: int = 1024):
        super().__init__()
        self.blocks = nn.ModuleList(_Mixed(width) for _ in range(depth))
        self.register_buffer("table", torch.ones(positions, width))
        self.register_buffer("unread", torch.zeros(positions // 2, width))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        x = x + self.table[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Mixed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("mix", torch.eye(width) * 0.5)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) @ self.mix


class TiedBatchNorm(nn.Module):
    """An embedding tied to the output head, and a BatchNorm whose running statistics change."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids, labels):
        return F.cross_entropy(self.head(torch.relu(self.bn(self.emb(ids)))), labels)


class TinyTransformer(nn.Module):
    """One pre-norm attention + MLP block between an embedding and a head (optionally tied);
    its loss is cross entropy over every token."""

    def __init__(self, vocab: int = 16, d: int = 8, heads: int = 2, ffn: int = 16, causal: bool = True,
                 tie: bool = False, rms: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.RMSNorm(d) if rms else nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, ffn)
        self.out = nn.Linear(ffn, d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids, labels):
        h = self.emb(ids)
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = h + self.out(F.gelu(self.fc(self.ln2(h))))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


__all__ = ["BufferedStack", "MLP", "Residual", "ResidualStack", "TiedBatchNorm", "TinyTransformer", "mlp"]


def meta_gpt2():
    """GPT-2, 4 layers of hidden 256 (8 heads), vocabulary 1024, batch 16 x 128 tokens, on meta."""
    model, (args, kwargs) = zoo.gpt2(layers=4, hidden=256, heads=8, vocab=1024, seq=128, batch=16, device="meta")
    return model, {"input_ids": args[0], **kwargs}


def meta_llama():
    """LLaMA, 4 layers of hidden 512 (8 heads, 2 KV heads, FFN 1376), vocabulary 2048, batch 16 x 256
    tokens, on meta."""
    model, (args, kwargs) = zoo.llama(layers=4, hidden=512, heads=8, kv_heads=2, ffn=1376, vocab=2048, seq=256,
                                      batch=16, device="meta")
    return model, {"input_ids": args[0], **kwargs}
