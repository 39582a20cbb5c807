"""A sharded parameter reached through views is gathered again in backward as the parameter is
(autopar/comm/regather.py), and the plan's records say so: when the gather is on a view of the
parameter (the cost graph and the records follow views to their root, ``core.ir.view_root``), and
when the consumer that keeps the gathered tensor reads it through views (``plan.records._keeps``).
Before, full-size Falcon-Mamba's program issued 64 backward all-gathers its plan did not record,
and FSDP on a depthwise convolution whose weight is squeezed and unsqueezed one."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar import Cluster, baselines
from autopar.core.ir import aliases_input, view_root

aten = torch.ops.aten


def test_view_ops_are_those_whose_result_aliases_their_first_input():
    views = [aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default, aten.t.default,
             aten.slice.Tensor, aten.select.int, aten.expand.default, aten.alias.default, aten.transpose.int]
    others = [aten.detach.default, aten._unsafe_view.default, aten.clone.default, aten.mul.Tensor,
              aten.add_.Tensor, aten.split.Tensor]  # detach aliases in its schema only; split returns a list
    assert all(aliases_input(op) for op in views)
    assert not any(aliases_input(op) for op in others)
    for op in views:  # at run time the result's _base is the parameter
        p = nn.Parameter(torch.randn(4, 1, 3))
        args = {aten.view.default: ([12],), aten.squeeze.dim: (1,), aten.unsqueeze.default: (0,),
                aten.permute.default: ([2, 1, 0],), aten.slice.Tensor: (0, 0, 2), aten.select.int: (0, 1),
                aten.expand.default: ([2, 4, 1, 3],), aten.transpose.int: (0, 2)}.get(op, ())
        x = p[:, 0] if op is aten.t.default else p
        assert op(x, *args)._base is p


def test_view_root_follows_a_chain_of_views():
    gm = torch.fx.symbolic_trace(lambda w, x: torch.ops.aten.mul.Tensor(
        torch.ops.aten.unsqueeze.default(torch.ops.aten.squeeze.dim(w, 1), 1), x))
    nodes = {n.name: n for n in gm.graph.nodes}
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert view_root(mul.args[0]) is nodes["w"]
    assert view_root(mul) is mul


class DepthwiseConv(nn.Module):
    def __init__(self, c: int = 64, k: int = 4):
        super().__init__()
        self.inp = nn.Linear(c, c)
        self.conv = nn.Conv1d(c, c, k, groups=c, padding=k - 1)

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)
        w = self.conv.weight.squeeze(1).unsqueeze(1)  # as transformers' Mamba passes it
        y = F.conv1d(h, w, self.conv.bias, padding=3, groups=h.shape[1])[..., : x.shape[1]]
        return y.square().mean()


def _collective_diffs(compiled) -> list:
    return [rank.collective_diff() for rank in compiled.verify().ranks]


def test_fsdp_records_the_gather_again_of_a_weight_its_consumer_keeps_through_views():
    x = torch.randn(8, 32, 64, device="meta")
    model, cluster = DepthwiseConv().to("meta"), Cluster.local(4)
    plan = baselines.fsdp(model, cluster, example_inputs=(x,))
    assert _collective_diffs(autopar.compile(model, cluster, example_inputs=(x,), plan=plan)) == [(Counter(), Counter())]


@pytest.mark.slow
def test_full_size_falcon_mamba_records_the_gathers_again_of_its_parameters_views():
    pytest.importorskip("transformers")
    from autopar.zoo_hf import architectures, build_full

    arch = next(a for a in architectures() if a.class_name == "FalconMambaForCausalLM")
    model, inputs = build_full(arch, batch=32, seq=1024)
    compiled = autopar.compile(model, Cluster.preset("dgx-a100", nodes=1), example_inputs=inputs)
    assert _collective_diffs(compiled) == [(Counter(), Counter())]
