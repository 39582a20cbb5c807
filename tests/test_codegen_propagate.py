"""propagate(): greedy forward propagation of shardings from the placeholders."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.core.errors import CodegenError
from autopar.core.ir import Strategy
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.capture import capture
from autopar.planner.propagate import propagate

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


@pytest.fixture(scope="module")
def gm():
    return capture(TwoLinear(), (torch.randn(4, 8),)).graph_module


def test_batch_sharding_flows_through_and_parameters_stay_replicated(gm):
    a = propagate(gm, (2,), {"x": (S0,)})
    assert a.node_strategies["linear"] == Strategy(((S0,), (R,), (R,)), ((S0,),))
    assert a.node_strategies["relu"].outputs == ((S0,),)
    assert a.node_strategies["linear_1"].outputs == ((S0,),)
    assert a.node_strategies["sum_1"].outputs == ((P,),)  # a sum over the sharded batch
    assert a.output_shardings == ((R,),)  # the loss: the pending sum reduced
    assert a.placeholder_shardings["p_a_weight"] == (R,)


def test_column_then_row_weights_give_megatron(gm):
    a = propagate(gm, (2,), {"p_a_weight": (S0,), "p_a_bias": (S0,), "p_b_weight": (S1,)})
    assert a.node_strategies["linear"].outputs == ((S1,),)
    assert a.node_strategies["linear_1"].inputs[:2] == ((S1,), (S1,))
    assert a.node_strategies["linear_1"].outputs == ((P,),)


def test_forced_strategies_are_kept_and_unknown_names_rejected(gm):
    rep = Strategy(((R,),), ((R,),))
    a = propagate(gm, (2,), {"x": (S0,)}, node_strategies={"relu": rep})
    assert a.node_strategies["relu"] == rep
    assert a.node_strategies["linear_1"].inputs[0] == (R,)  # follows the forced output
    with pytest.raises(CodegenError, match="no graph node is named"):
        propagate(gm, (2,), {"nope": (S0,)})


def test_a_mesh_axis_of_size_one_only_replicates(gm):
    a = propagate(gm, (1, 2), {"x": (R, S0)})
    assert a.node_strategies["linear"].outputs == ((R, S0),)
