"""A dispatch written the way routed-MoE layers write it: tokens permuted by expert into an
``empty_like`` buffer with ``index_put`` (``buf[perm] = ...``) and read back in the original
order. Capture makes the buffer defined (``zeros_like``), every op has a rule, the planner may
shard the hidden dim through the write, and two ranks train like one process."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from autopar import baselines
from autopar.passes.capture import capture
from autopar.passes.rules import coverage
from one_process import sgd_mismatches


class SortedExperts(nn.Module):
    """Each token goes to its top-1 expert; tokens are grouped by expert with a sort, written
    into a buffer in expert order, each expert's weight applied by a batched matmul over the
    whole buffer, and the outputs are put back in token order."""

    def __init__(self, d: int = 8, experts: int = 4, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, d, d) / d**0.5)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids).flatten(0, 1)  # (tokens, d)
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        grouped = torch.empty_like(x)
        grouped[torch.arange(x.shape[0])] = x[order]  # index_put of every row
        y = torch.einsum("td,tdf->tf", grouped, self.w[expert[order]])
        back = torch.empty_like(y)
        back[order] = y  # the inverse permutation, as a write
        logits = self.out(x + back * gate.unsqueeze(-1))
        return nn.functional.cross_entropy(logits, labels.flatten())


def _batch():
    return torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))


def test_empty_buffers_become_zeros_and_the_write_has_a_rule():
    torch.manual_seed(0)
    cap = capture(SortedExperts(), _batch())
    targets = {str(n.target) for n in cap.graph_module.graph.nodes if n.op == "call_function"}
    assert "aten.index_put.default" in targets and "aten.zeros_like.default" in targets
    assert "aten.empty_like.default" not in targets
    cov = coverage(cap.graph_module)
    assert [op for op, ok in cov.items() if not ok] == []


@pytest.mark.slow
def test_sorted_dispatch_trains_on_two_ranks_like_one_process():
    torch.manual_seed(0)
    wrong = sgd_mismatches(SortedExperts(), _batch(), {"autopar": None, "megatron": partial(baselines.megatron, tp=2),
                                                "data parallel": baselines.data_parallel})
    assert {name: why for name, why in wrong.items() if why} == {}
