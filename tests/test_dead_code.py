"""What no output depends on is not planned (``passes.capture.drop_dead``): export keeps a value
alive by a dtype assert alone (``x.float()`` on a float tensor), code generation then drops it, and
the plan priced its compute and collectives (full-size MRA on 2x8 A100: FLOPs 1.183 of executed,
60 all-gathers predicted that the program did not issue)."""

import torch
from torch import nn

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.passes.capture import capture


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.dropped = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        self.dropped(x).float()  # computed, asserted to be float, never read
        return self.used(x).pow(2).mean()


def test_a_value_only_an_assert_reads_is_not_planned():
    torch.manual_seed(0)
    model, x = Dropped(), torch.randn(8, 16)
    linears = [n for n in capture(model, (x,)).graph_module.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 1
    cluster = Cluster.local(world_size=2)
    compiled = compile(model, cluster, example_inputs=(x,), plan=baselines.fsdp(model, cluster, example_inputs=(x,)))
    for rank in compiled.verify().ranks:
        assert rank.flops_ratio == 1.0
        assert rank.collective_diff() in (None, ({}, {}))
