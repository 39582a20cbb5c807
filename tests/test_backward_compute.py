"""The backward compute a plan prices is the backward autograd runs: a call no gradient reaches
runs none (a frozen first layer, a value read only for its shape), and a frozen weight's
gradient GEMM is not made (LoRA-style fine-tuning: the base linear computes only its input's
gradient). Before, every call was priced with the full backward of every floating input."""

from __future__ import annotations

import torch
from torch import nn

from autopar import Cluster, Options, baselines
from autopar.passes.capture import capture
from autopar.planner.costgraph import PlannedGraph, build_cost_graph
from autopar.planner.costs import CostModel

D = 256


class Adapted(nn.Module):
    """A frozen first layer, a trained one, a frozen base with a trained low-rank adapter beside
    it, and a trained head of the base's shape."""

    def __init__(self):
        super().__init__()
        self.first, self.mid, self.base, self.head = (nn.Linear(D, D) for _ in range(4))
        self.down, self.up = nn.Linear(D, 8, bias=False), nn.Linear(8, D, bias=False)
        for p in (*self.first.parameters(), *self.base.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        h = torch.relu(self.mid(self.first(x)))
        h = torch.relu(self.base(h) + self.up(self.down(h)))
        return self.head(h).square().mean()


def _backward_seconds(model, cluster) -> dict[str, float]:
    """Per linear (by module): the cost graph's backward seconds of its replicated strategy."""
    cap = capture(model, (torch.randn(16, 64, D),))
    graph = build_cost_graph(PlannedGraph.of(cap), CostModel(cluster, Options()))
    by_name = {n.name: n for n in cap.graph_module.graph.nodes}
    out = {}
    for node in graph.nodes:
        if node.op == str(torch.ops.aten.linear.default):
            module = by_name[node.name].meta["autopar_module"].rsplit(".", 1)[-1]
            out[module] = float(node.compute[0] - node.forward[0])
    return out


def test_a_call_no_gradient_reaches_is_priced_with_no_backward_and_a_frozen_weight_without_its_gemm():
    seconds = _backward_seconds(Adapted(), Cluster.preset("dgx-a100", nodes=1))
    assert seconds["first"] == 0.0  # frozen, on the raw batch: autograd records nothing for it
    # of head's GEMM shape: base makes its input's gradient only, mid (on first's output) its weight's only
    assert 0.0 < seconds["base"] < 0.75 * seconds["head"]
    assert 0.0 < seconds["mid"] < 0.75 * seconds["head"]
    trained = Adapted().requires_grad_(True)
    assert _backward_seconds(trained, Cluster.preset("dgx-a100", nodes=1))["first"] > 0.0


def test_a_data_parallel_plan_of_a_frozen_model_is_faster_by_the_backward_it_does_not_run():
    x = torch.randn(16, 64, D, device="meta")
    cluster = Cluster.preset("dgx-a100", nodes=1)
    adapted = baselines.data_parallel(Adapted().to("meta"), cluster, example_inputs=(x,))
    trained = baselines.data_parallel(Adapted().to("meta").requires_grad_(True), cluster, example_inputs=(x,))
    assert adapted.time.compute < trained.time.compute
    first = {n.module.rsplit(".", 1)[-1]: n for n in adapted.nodes if n.op == str(torch.ops.aten.linear.default)}
    again = {n.module.rsplit(".", 1)[-1]: n for n in trained.nodes if n.op == str(torch.ops.aten.linear.default)}
    assert 0.0 < first["first"].compute_time < again["first"].compute_time  # its forward only
    assert first["head"].compute_time == again["head"].compute_time
