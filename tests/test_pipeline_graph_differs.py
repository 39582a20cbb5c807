"""A model that traces another graph at the micro-batch size (it branches on its batch): the
pipelined plan's stages cannot be cut from it, so ``compile`` and the grid baseline fall back to
their one-stage plan and say why, instead of raising PipelineError (full-size AFMoE: the grid
baseline's pipelined plan on 1x8 A100 raised it)."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar import Cluster, baselines
from autopar.core.options import Options


class BatchBranch(nn.Module):
    def __init__(self, d: int = 32, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if x.shape[0] > 8:  # the whole batch only
            x = x * 2
        return x.square().mean()


def test_compile_falls_back_to_one_stage_where_micro_batches_trace_another_graph():
    x = torch.randn(16, 32)
    compiled = autopar.compile(BatchBranch(), Cluster.local(4), example_inputs=(x,),
                               options=Options(pipeline=True, micro_batches=4))
    assert not compiled.plan.stages
    assert any("pipelined plan" in why and "cannot run" in why for why in compiled.plan.why)


def test_the_grid_baseline_falls_back_to_its_one_stage_grid():
    x = torch.randn(16, 32)
    plan = baselines.grid(BatchBranch(), Cluster.local(4), example_inputs=(x,),
                          options=Options(pipeline=True, micro_batches=4))
    assert not plan.stages
    assert any("cannot run" in why for why in plan.why)
