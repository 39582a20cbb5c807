"""Which inputs an op's backward hands a gradient, as autograd says at capture
(``meta["autopar_grad_in"]``, passes/capture/saved.py): ``type_as`` reads only its second input's
dtype, so no gradient flows back along that edge and the plan records no backward collective on
it (full-size Gemma-4 on 2x8 A100: 30 backward all-gathers recorded that the program never
issued)."""

from __future__ import annotations

from collections import Counter

import pytest
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


@pytest.mark.slow
def test_gemma4_records_no_backward_collective_into_type_as():
    pytest.importorskip("transformers")
    import autopar
    from autopar import Cluster
    from autopar.zoo_hf import architectures, build_full

    arch = next(a for a in architectures() if a.class_name == "Gemma4ForCausalLM")
    model, inputs = build_full(arch, batch=32, seq=1024, overrides={"num_hidden_layers": 4})
    compiled = autopar.compile(model, Cluster.preset("dgx-a100", nodes=2), example_inputs=inputs)
    assert [r.collective_diff() for r in compiled.verify().ranks] == [(Counter(), Counter())]


class ComplexRotate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("turn", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)

    def forward(self, x):
        h = self.a(x)
        z = torch.view_as_complex(h.reshape(4, 4, 2)) * self.turn
        return torch.view_as_real(z).flatten(1).type_as(h).sum()


def test_a_gradient_reaches_complex_values():
    from autopar.core.ir import gradient_values

    cap = capture(ComplexRotate(), (torch.randn(4, 8),))
    graph = cap.graph_module.graph
    grads = gradient_values(graph, {i.node for i in cap.inputs if i.kind == "parameter"})
    ops = {n.target for n in graph.nodes if n.name in grads}
    assert {torch.ops.aten.view_as_complex.default, torch.ops.aten.mul.Tensor,
            torch.ops.aten.view_as_real.default, torch.ops.aten.type_as.default} <= ops
