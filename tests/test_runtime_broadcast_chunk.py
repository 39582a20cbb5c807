"""This rank's block of a replicated tensor (autopar/comm/plain.py ``chunk``, the differentiable
``Chunk``) in a storage of its own size, as the plan counts it: a broadcast view stays a view (a copy of an expanded gather index
materialised it at full size, and the gather saved it for backward: full-size BigBird, 5.9 GiB per
device the plan did not predict), and a block of an activation's rows is copied (the view of rows a masked fill
saved kept the whole mask alive: full-size Doge, 0.86 GiB)."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar import Cluster, baselines
from autopar.comm.mesh import AxisGroup
from autopar.comm.differentiable import Chunk
from autopar.comm.plain import chunk


def test_a_broadcast_block_is_a_view_and_a_block_of_an_activations_rows_a_copy():
    ax = AxisGroup(size=2, coord=1, group=None)
    base = torch.arange(6).view(1, 6, 1)
    wide = base.expand(4, 6, 5)
    block = chunk(wide, ax, 0)
    assert torch.equal(block, wide[2:])
    assert block.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    dense = torch.randn(4, 6)
    for dim, want in ((0, dense[2:]), (1, dense[:, 3:])):
        block = Chunk.apply(dense, ax, dim, "all_gather")
        assert torch.equal(block, want) and block.is_contiguous()
        assert block.untyped_storage().nbytes() == block.numel() * block.element_size()  # its own storage
    weight = torch.nn.Parameter(torch.randn(4, 6))  # lives anyway: a block of its rows stays a view
    assert Chunk.apply(weight, ax, 0, "all_gather").untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


class Picks(nn.Module):
    """Each token picks features by a fixed pattern: a gather whose index is an expanded arange."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(d, d)

    def forward(self, x):
        h = self.up(x)
        b, t, d = x.shape
        idx = (torch.arange(d, device=x.device) * 4).view(1, 1, d).expand(b, t, d)
        return self.down(h.gather(2, idx)).square().mean()


def test_a_data_parallel_gather_of_an_expanded_index_keeps_what_the_plan_predicts():
    x = torch.randn(8, 128, 64, device="meta")
    plan = baselines.data_parallel(Picks().to("meta"), Cluster.local(2), example_inputs=(x,))
    report = autopar.compile(Picks().to("meta"), Cluster.local(2), example_inputs=(x,), plan=plan).verify()
    assert report.ok, report.table()


class Masked(nn.Module):
    """Scores masked by a causal mask made whole as long as the batch (as transformers' attention
    masks are), then cut by rows for the batch-split scores: the masked fill keeps its block for
    backward."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(32, 32)

    def forward(self, x):
        b, t, _ = x.shape
        causal = torch.ones(t, t, device=x.device).tril().expand(b, t, t)
        scores = (self.q(x) @ x.transpose(1, 2)).masked_fill(causal == 0, -1e4)
        return (scores.softmax(-1) @ x).square().mean()


def test_a_data_parallel_masked_fill_keeps_the_block_of_its_mask_the_plan_predicts():
    x = torch.randn(8, 64, 32, device="meta")
    plan = baselines.data_parallel(Masked().to("meta"), Cluster.local(2), example_inputs=(x,))
    report = autopar.compile(Masked().to("meta"), Cluster.local(2), example_inputs=(x,), plan=plan).verify()
    (rank,) = report.ranks
    saved = rank.measured.memory["activations"]  # this tiny model's peak is mostly temporaries
    assert abs(rank.predicted.memory["activations"] - saved) <= 0.01 * saved, report.table()
