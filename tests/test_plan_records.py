"""The pieces the plan's collective records are read from: which values get a gradient, and which
inputs an op saves for backward, as capture saw autograd save them (a sharded parameter is
gathered again only where one is)."""

import torch
from torch.nn import functional as F

from autopar.core.ir import gradient_values
from autopar.passes.capture import capture
from autopar.plan.records import saved_inputs


class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.up = torch.nn.Linear(8, 8)

    def forward(self, x):
        top = self.gate(x).topk(1, dim=-1).indices  # integer: no gradient through it
        mask = F.one_hot(top.squeeze(-1), 4).to(x.dtype)
        return self.up(x).sum(-1, keepdim=True) * mask


def _graph(module, *args):
    return torch.export.export(module, args, strict=False).graph


def test_an_integer_value_stops_the_gradient():
    graph = _graph(Router(), torch.randn(3, 8))
    params = {n.name for n in graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
    grads = gradient_values(graph, params)
    by_target = {str(n.target): n.name for n in graph.nodes if n.op == "call_function"}
    model = Router()  # eager autograd: the gate, read through integer indices only, gets no gradient
    model(torch.randn(3, 8)).sum().backward()
    assert {n for n in params if n in grads} == {"p_" + k.replace(".", "_") for k, p in model.named_parameters()
                                                 if p.grad is not None} == {"p_up_weight", "p_up_bias"}
    assert by_target["aten.topk.default"] not in grads  # its values are floating, but nothing reads them
    assert by_target["aten.one_hot.default"] not in grads
    assert by_target["aten.to.dtype"] not in grads  # the float mask made from the indices
    assert by_target["aten.mul.Tensor"] in grads


class Positions(torch.nn.Module):
    """Funnel's relative positions: computed from ``arange``, cast with ``type_as`` to the hidden
    states' dtype; no gradient reaches them, though an argument of ``type_as`` has one."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        pos = torch.arange(8).type_as(h) * 0.5
        return (h * pos).sum()


def test_no_gradient_reaches_a_value_autograd_saw_none_reach():
    graph = capture(Positions(), (torch.randn(3, 8),)).graph_module.graph  # capture runs autograd
    params = {n.name for n in graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
    grads = gradient_values(graph, params)
    by_target = {str(n.target): n.name for n in graph.nodes if n.op == "call_function"}
    assert by_target["aten.type_as.default"] not in grads
    assert [n for n in graph.nodes if n.target == torch.ops.aten.mul.Tensor and n.name in grads] != []


class Linear(torch.nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.ones(8)) if scaled else None

    def forward(self, x):
        if self.scale is not None:  # the matmul's input then needs a gradient
            x = x * self.scale
        return torch.ops.aten.addmm.default(self.fc.bias, x, self.fc.weight.t())


def _saved_by_addmm(module) -> frozenset[int]:
    graph = capture(module, (torch.randn(3, 8),)).graph_module.graph
    (addmm,) = [n for n in graph.nodes if n.target == torch.ops.aten.addmm.default]
    return saved_inputs(addmm)


def test_a_bias_is_never_saved_and_a_weight_only_when_its_input_needs_a_gradient():
    # inputs: bias, x, weight.t(); a raw input needs no gradient, so the weight is not kept for it
    assert _saved_by_addmm(Linear(scaled=False)) == frozenset({1})
    assert _saved_by_addmm(Linear(scaled=True)) == frozenset({1, 2})
