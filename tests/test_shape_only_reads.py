"""A value read only for its shape (``zeros_like``, as MRA's attention does without its CUDA
kernel) gets no gradient, so the call that made it runs no backward: it unpacks nothing (a
sharded weight it saved is not gathered again) and executes no backward FLOPs
(``core.ir.gradient_values`` walks back from the outputs through each call's
``meta["autopar_grad_in"]``). Before, full-size MRA on 2x8 recorded 12 backward all-gathers its
program never issued and 4.6 % more FLOPs than it executed."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

import autopar
from autopar import Cluster, baselines
from autopar.core.ir import gradient_inputs, gradient_values
from autopar.passes.capture import capture


class ShapeOnly(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.first, self.query, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.first(x)
        context = torch.zeros_like(self.query(h).float())  # the query's values are never read
        return (self.out(context) + h).square().mean()


def test_no_gradient_reaches_a_value_read_for_its_shape():
    cap = capture(ShapeOnly(), (torch.randn(4, 16, 64),))
    graph = cap.graph_module.graph
    params = {i.name: i.node for i in cap.inputs if i.kind == "parameter"}
    reached = gradient_values(graph, set(params.values()))
    assert params["first.weight"] in reached and params["out.weight"] in reached
    assert params["query.weight"] not in reached and params["query.bias"] not in reached
    linears = [n for n in graph.nodes if n.target is torch.ops.aten.linear.default]
    first, query, out = linears
    assert gradient_inputs(first, reached) == (False, True, True)  # the batch needs none
    assert gradient_inputs(query, reached) == (False, False, False)  # its output gets no gradient
    assert gradient_inputs(out, reached) == (False, True, True)  # zeros need none


def test_fsdp_plan_of_a_shape_only_read_matches_its_program():
    x = torch.randn(8, 32, 64, device="meta")
    model, cluster = ShapeOnly().to("meta"), Cluster.local(4)
    plan = baselines.fsdp(model, cluster, example_inputs=(x,))
    ranks = autopar.compile(model, cluster, example_inputs=(x,), plan=plan).verify().ranks
    assert [r.collective_diff() for r in ranks] == [(Counter(), Counter())]
    assert all(r.predicted.flops == r.measured.flops for r in ranks)
