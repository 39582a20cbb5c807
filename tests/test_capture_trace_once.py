"""One trace to functional ATen (``trace.exported_to_aten``) captures the graph that exporting and then
``run_decompositions({})`` captures (``trace.exported_then_decomposed``): the same nodes, names, targets,
arguments, fake values, module paths, inputs and signature, except that inside a ``no_grad``
block the second trace loses each node's innermost module, which one trace keeps. (The raw
programs differ in what capture drops: the second trace keeps dtype asserts and the values only
they read.)"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

from autopar import CaptureError
from autopar.passes.capture import capture
from autopar.zoo_hf import architectures, build

trace_module = importlib.import_module("autopar.passes.capture.trace")  # the package's trace is the function
capture_module = importlib.import_module("autopar.passes.capture")


def _value(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype, tuple(val.stride()) if val.layout == torch.strided else None)
    if isinstance(val, (tuple, list)):
        return tuple(_value(v) for v in val)
    return repr(val)


def _rows(graph: torch.fx.Graph) -> list:
    """Each node as everything planning reads of it."""
    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: f"%{n.name}")

    return [(n.op, n.name, str(n.target), str(arg(n.args)), str(arg(n.kwargs)), _value(n.meta.get("val")),
             tuple((k, v[0] if isinstance(v, tuple) else v) for k, v in (n.meta.get("nn_module_stack") or {}).items()))
            for n in graph.nodes]


def _assert_same(model, args, kwargs, monkeypatch):
    captured = {}
    for how in (trace_module.exported_then_decomposed, trace_module.exported_to_aten):
        monkeypatch.setattr(capture_module, "trace", how)
        captured[how] = capture(model, args, kwargs=kwargs)
    twice, once = captured.values()
    assert _rows(once.graph_module.graph) == _rows(twice.graph_module.graph)
    assert once.inputs == twice.inputs and once.outputs == twice.outputs and once.stamped == twice.stamped
    assert str(once.exported_program.graph_signature) == str(twice.exported_program.graph_signature)
    return once


class _Constants(nn.Module):
    """Makes tensor constants in forward (export lifts them) among clones of its own."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x).clone()
        y = y.masked_fill(y > 0, torch.tensor(-1.0))  # a constant made in forward: lift_fresh_copy
        z = torch.flip(y, [0]).clone() * torch.tensor([2.0] * 8)
        return (z + y.clone()).sum()


def test_constants_made_in_forward_trace_once_as_clones_named_as_a_second_trace_names_them(monkeypatch):
    model, x = _Constants(), torch.randn(4, 8)
    once, twice = (how(model, (x,), {}) for how in (trace_module.exported_to_aten,
                                                    trace_module.exported_then_decomposed))
    assert _rows(once.graph) == _rows(twice.graph)
    once = _assert_same(model, (x,), {}, monkeypatch)
    targets = [n.target for n in once.graph_module.graph.nodes]
    assert torch.ops.aten.lift_fresh_copy.default not in targets
    assert targets.count(torch.ops.aten.clone.default) == 5  # three clones of forward's, two of its constants


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "Qwen3NextForCausalLM", "MixtralForCausalLM"])
def test_hf_models_trace_once_as_they_trace_twice(name, monkeypatch):
    # T5 makes constants in forward; Qwen3-Next is a hybrid of delta-rule and attention layers;
    # Mixtral routes tokens to experts
    model, inputs = build(next(a for a in architectures() if a.class_name == name))
    _assert_same(model, (), inputs, monkeypatch)


class _Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    @torch.no_grad()
    def forward(self, x):
        return self.proj(x).softmax(-1)


class _Gated(nn.Module):
    """Weights its output by scores made without gradients (as HY-V4's indexer makes them)."""

    def __init__(self):
        super().__init__()
        self.scorer, self.out = _Scorer(), nn.Linear(8, 8)

    def forward(self, x):
        return (self.out(x) * self.scorer(x).sum(-1, keepdim=True)).sum()


def test_one_trace_keeps_the_modules_of_a_no_grad_block_and_is_otherwise_the_same(monkeypatch):
    captured = {}
    for how in (trace_module.exported_then_decomposed, trace_module.exported_to_aten):
        monkeypatch.setattr(capture_module, "trace", how)
        captured[how] = capture(_Gated(), (torch.randn(2, 8),))
    twice, once = captured.values()
    modules = {n.name: n.meta["autopar_module"] for n in once.graph_module.graph.nodes}
    assert (modules["linear"], modules["linear_1"], modules["softmax"]) == ("out", "scorer.proj", "scorer")
    assert [r[:-1] for r in _rows(once.graph_module.graph)] == [r[:-1] for r in _rows(twice.graph_module.graph)]
    assert once.inputs == twice.inputs


def test_a_model_that_does_not_trace_raises_the_usual_capture_error():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x[: int(x.sum() > 0) + 1]

    with pytest.raises(CaptureError, match="could not trace") as info:
        trace_module.trace(DataDependent(), (torch.randn(3),), {})
    assert "tensor *values*" in info.value.hint


def test_a_model_that_prints_and_warns_while_traced_says_only_that(capfd):
    class Talks(nn.Module):
        def forward(self, x):
            print("from forward")
            warnings.warn("careful", UserWarning)
            return x * 2

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trace_module.trace(Talks(), (torch.randn(3),), {})
    out, err = capfd.readouterr()
    assert out == "from forward\n" * 2 and err == ""  # forward runs twice (the module docstring)
    assert {str(w.message) for w in warned if w.category is UserWarning} == {"careful"}


def test_a_model_asserting_on_a_tensors_value_keeps_its_assert(monkeypatch):
    class Checks(nn.Module):  # as XLM's forward checks its lengths
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            torch._check(x.ne(0).sum(1).max().item() <= x.shape[1])
            return self.proj(x).sum()

    model, x = Checks(), torch.randn(4, 8)
    monkeypatch.setattr(capture_module, "trace", trace_module.exported_then_decomposed)
    twice = capture(model, (x,))
    monkeypatch.undo()
    once = capture(model, (x,))  # capture's own trace
    targets = [n.target for n in once.graph_module.graph.nodes]
    assert torch.ops.aten._assert_scalar.default in targets and torch.ops.aten.item.default in targets
    assert _rows(once.graph_module.graph) == _rows(twice.graph_module.graph)
