"""Mean cross entropy is captured as sum / count: same loss, and shardable over the batch."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar import zoo
from autopar.core.ir import spec_of_node
from autopar.core.placement import P, R, Shard
from autopar.passes.capture import capture
from autopar.passes.rules.registry import strategies

aten = torch.ops.aten


def run_graph(cap, model, args, kwargs):
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    state = {**dict(model.named_parameters()), **dict(model.named_buffers()),
             **cap.exported_program.constants}
    values = [bound[i.name] if i.kind == "user_input" else state[i.name] for i in cap.inputs]
    with torch.no_grad():
        return torch.utils._pytree.tree_leaves(cap.graph_module(*values))


def losses(cap):
    return [n for n in cap.graph_module.graph.nodes if n.target is aten.cross_entropy_loss.default]


def loss_node(cap):
    (out,) = [o for o in cap.outputs if o.kind == "loss"]
    return next(n for n in cap.graph_module.graph.nodes if n.name == out.node)


def with_ignored_labels(name):
    model, (args, kwargs) = getattr(zoo, name)()
    labels = kwargs["labels"].clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return model, args, {"labels": labels}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_mean_cross_entropy_becomes_sum_over_count_with_the_same_value(name):
    model, args, kwargs = with_ignored_labels(name)
    cap = capture(model, args, kwargs=kwargs)
    (ce,) = losses(cap)
    assert ce.args[3] == 2 and ce.args[4] == -100  # reduction sum, ignore_index kept
    loss = loss_node(cap)
    assert loss.target is aten.div.Tensor and loss.args[0] is ce
    count = loss.args[1]
    assert count.target is aten.sum.default
    cast = count.args[0]
    assert cast.target is aten._to_copy.default and cast.kwargs == {"dtype": torch.float32}
    assert cast.args[0].target is aten.ne.Scalar and cast.args[0].args[1] == -100
    for node in (ce, loss, count, cast, cast.args[0]):
        val = node.meta["val"]
        assert isinstance(val, torch._subclasses.FakeTensor)
        assert node.meta["autopar_tensor"].shape == tuple(val.shape)
        assert node.meta["autopar_module"] == ce.meta["autopar_module"]
    got = run_graph(cap, model, args, kwargs)[0]
    with torch.no_grad():
        want = model(*args, **kwargs).loss
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_rewritten_loss_shards_over_the_batch_with_partial_results():
    model, args, kwargs = with_ignored_labels("gpt2")
    cap = capture(model, args, kwargs=kwargs)
    (ce,) = losses(cap)
    loss = loss_node(cap)
    count = loss.args[1]
    batch = (Shard(0),)

    def offers(node, inputs, outputs):
        return any(s.inputs == inputs and s.outputs == outputs
                   for s in strategies(spec_of_node(node), (2,), warn=False))

    assert offers(ce, (batch, batch), ((P,),))
    assert offers(count.args[0], (batch,), (batch,))  # the cast of the mask
    assert offers(count, (batch,), ((P,),))
    assert offers(loss, ((P,), (R,)), ((P,),))  # the count is all-reduced first (a scalar)


class _Loss(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.lin = nn.Linear(8, 5)
        self.options = options

    def forward(self, x, t):
        return F.cross_entropy(self.lin(x), t, **self.options)


def test_bf16_logits_count_in_float32_and_return_bf16():
    torch.manual_seed(0)
    model = _Loss().to(torch.bfloat16)
    x, t = torch.randn(300, 8, dtype=torch.bfloat16), torch.randint(0, 5, (300,))
    t[::7] = -100
    cap = capture(model, (x, t))
    loss = loss_node(cap)
    assert loss.target is aten._to_copy.default and loss.kwargs == {"dtype": torch.bfloat16}
    div = loss.args[0]
    assert div.target is aten.div.Tensor and div.meta["val"].dtype == torch.float32
    assert div.args[1].args[0].kwargs == {"dtype": torch.float32}  # 257+ counts stay exact
    (got,) = run_graph(cap, model, (x, t), {})
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, model(x, t).detach(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("options, target", [
    ({"label_smoothing": 0.1}, "index"),
    ({"weight": torch.rand(5) + 0.5}, "index"),
    ({}, "probabilities"),
    ({"reduction": "sum"}, "index"),
])
def test_other_cross_entropy_variants_are_left_alone(options, target):
    model = _Loss(**options)
    x = torch.randn(4, 8)
    t = torch.randint(0, 5, (4,)) if target == "index" else torch.softmax(torch.randn(4, 5), 1)
    cap = capture(model, (x, t))
    (ce,) = losses(cap)
    assert loss_node(cap) is ce
    (got,) = run_graph(cap, model, (x, t), {})
    torch.testing.assert_close(got, model(x, t).detach())
