"""Complex activations from a complex buffer: a Llama written as Meta's reference code writes it
(rotary table as a complex64 buffer, view_as_complex / complex mul / view_as_real) captures with
a rule for every op and trains on two ranks like one process under autopar, FSDP and Megatron."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar import baselines
from autopar.passes.capture import capture
from autopar.passes.rules import coverage
from one_process import sgd_mismatches


def freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * table.view(1, z.shape[1], 1, z.shape[-1])).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.w1, self.w2 = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

    def forward(self, x, table):
        b, t, d = x.shape
        y = self.n1(x)
        q, k, v = (w(y).view(b, t, self.heads, d // self.heads) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, table), rotary(k, table)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        return x + self.w2(F.silu(self.w1(self.n2(x))))


class MetaLlama(nn.Module):
    def __init__(self, vocab: int = 16, d: int = 8, heads: int = 2, layers: int = 2, seq: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.out = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("freqs_cis", freqs_cis(d // heads, 2 * seq), persistent=False)

    def forward(self, ids, labels):
        x, table = self.emb(ids), self.freqs_cis[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x, table)
        return F.cross_entropy(self.out(self.norm(x)).flatten(0, 1), labels.flatten())


def _batch():
    return torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))


def test_complex_rotary_captures_with_a_rule_for_every_op():
    torch.manual_seed(0)
    cap = capture(MetaLlama(), _batch())
    cov = coverage(cap.graph_module)
    assert {"aten.view_as_complex.default", "aten.view_as_real.default", "aten.type_as.default"} <= set(cov)
    assert [op for op, ok in cov.items() if not ok] == []
    assert cap.buffers["freqs_cis"].dtype == torch.complex64


@pytest.mark.slow
def test_complex_rotary_llama_trains_on_two_ranks_like_one_process():
    torch.manual_seed(0)
    wrong = sgd_mismatches(MetaLlama(), _batch(), {"autopar": None, "fsdp": baselines.fsdp,
                                             "megatron": partial(baselines.megatron, tp=2)})
    assert {name: why for name, why in wrong.items() if why} == {}
