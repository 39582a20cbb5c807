"""This rank's block of a broadcast view stays a view (autopar/comm/plain.py ``chunk``): a
contiguous copy of an expanded gather index materialised it at full size, and the gather saved it
for backward (full-size BigBird: 5.9 GiB per device the plan did not predict, verify's peak ratio
0.54)."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar import Cluster, baselines
from autopar.comm.mesh import AxisGroup
from autopar.comm.plain import chunk


def test_a_broadcast_block_is_a_view_and_others_contiguous():
    ax = AxisGroup(size=2, coord=1, group=None)
    base = torch.arange(6).view(1, 6, 1)
    wide = base.expand(4, 6, 5)
    block = chunk(wide, ax, 0)
    assert torch.equal(block, wide[2:])
    assert block.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    dense = torch.randn(4, 6)
    block = chunk(dense, ax, 1)
    assert torch.equal(block, dense[:, 3:]) and block.is_contiguous()
    assert block.untyped_storage().nbytes() == block.numel() * block.element_size()


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
