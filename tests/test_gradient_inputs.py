"""Which inputs an op's backward hands a gradient, as autograd says at capture
(``meta["autopar_grad_in"]``, passes/capture/saved.py): ``type_as`` reads only its second input's
dtype, so the cost graph prices no backward collective on that edge."""

from __future__ import annotations

import torch
from torch import nn

from autopar.passes.capture import capture


class Cast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return (self.b(x).float().type_as(h) * h).sum()


def test_capture_records_the_inputs_a_backward_hands_a_gradient():
    nodes = {n.target: n for n in capture(Cast(), (torch.randn(4, 8),)).graph_module.graph.nodes
             if n.op == "call_function"}
    assert nodes[torch.ops.aten.type_as.default].meta["autopar_grad_in"] == frozenset({0})
    assert nodes[torch.ops.aten.mul.Tensor].meta["autopar_grad_in"] == frozenset({0, 1})
