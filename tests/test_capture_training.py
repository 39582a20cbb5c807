"""The training capture with a separate loss_fn: one wrapper (WithLoss) that keeps the user's
names for root parameters, buffers, tensor constants and layers, and programs that train."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.errors import InputError
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss, unwrap
from autopar.passes.capture.training import capture_for_training
from autopar.testing import run_distributed
from models import Residual, ResidualStack
from one_process import one_process


class Scaled(nn.Module):
    """Root-level state of every kind, and a child called ``model`` (as HF models have)."""

    def __init__(self):
        super().__init__()
        self.model = ResidualStack(4)
        self.head = nn.Linear(8, 4)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.register_buffer("shift", torch.full((4,), 0.25))
        self.scale = torch.linspace(1.0, 2.0, 8)  # neither parameter nor buffer: a lifted constant

    def forward(self, x):
        return self.head(self.model(x) * self.scale) * self.gain + self.shift


def test_a_loss_fn_capture_names_every_input_as_the_model_does():
    model, x, y = Scaled(), torch.randn(4, 8), torch.randn(4, 4)
    cap = capture_for_training(model, example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    kinds = {i.name: i.kind for i in cap.inputs}
    assert {n for n, k in kinds.items() if k == "parameter"} == {n for n, _ in model.named_parameters()}
    assert {n for n, k in kinds.items() if k == "buffer"} == {"shift"}
    assert {n for n, k in kinds.items() if k == "constant"} == {"scale"}
    assert set(cap.exported_program.constants) == {"scale"}  # where the runtime takes its value
    assert [n for n, k in kinds.items() if k == "user_input"] == ["args_0", "target"]
    assert cap.layers == tuple(f"model.blocks.{i}" for i in range(4))
    assert cap.stamped == ("model.blocks",)
    # the root parameter is a parameter of the graph, not a constant baked in
    gain = next(n for n in cap.graph_module.graph.nodes if n.op == "placeholder" and n.name == "p_gain")
    assert gain.users


def test_a_loss_fn_capture_of_a_root_sequential_finds_and_stamps_its_layers():
    model, x = nn.Sequential(*(Residual() for _ in range(5))), torch.randn(4, 8)
    cap = capture_for_training(model, example_inputs=(x,), example_target=torch.randn(4, 8), loss_fn=F.mse_loss)
    assert cap.layers == ("0", "1", "2", "3", "4")
    assert cap.stamped == ("",)
    assert [n for n, _ in model.named_parameters()] == [i.name for i in cap.inputs if i.kind == "parameter"]
    assert len(model) == 5  # stamping gave the container back whole


def test_with_loss_takes_the_target_by_keyword_or_last_and_follows_train_and_eval():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    wrapped = WithLoss(model, F.mse_loss)
    assert unwrap(wrapped) is model and unwrap(model) is model
    assert [n for n, _ in wrapped.named_parameters()] == ["0.weight", "0.bias"]
    wrapped.eval()
    assert not model.training and not model[1].training
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    assert torch.equal(wrapped(x, y), F.mse_loss(model(x), y))
    assert torch.equal(wrapped(x, target=y), F.mse_loss(model(x), y))
    wrapped.train()
    assert model.training and model[1].training
    with pytest.raises(InputError, match="loss_fn must be callable"):
        WithLoss(model, "mse")


def test_a_loss_fn_with_parameters_is_refused_and_one_with_buffers_is_a_constant():
    model, x, y = nn.Linear(4, 3), torch.randn(2, 4), torch.tensor([0, 2])
    with pytest.raises(InputError, match="has parameters of its own.*move them into the model"):
        WithLoss(model, nn.Bilinear(3, 3, 1))
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    cap = capture_for_training(model, example_inputs=(x,), example_target=y, loss_fn=weighted)
    assert {i.name for i in cap.inputs if i.kind == "parameter"} == {"weight", "bias"}
    constants = [i.name for i in cap.inputs if i.kind == "constant"]
    assert len(constants) == 1 and set(cap.exported_program.constants) == set(constants)


def test_capturing_the_wrapper_equals_capturing_the_model_in_names():
    model, x = Scaled(), torch.randn(4, 8)
    alone = capture(model, (x,))
    wrapped = capture(WithLoss(model, lambda out, target: (out - target).square().sum()), (x, torch.randn(4, 4)))
    names = [(i.kind, i.name) for i in alone.inputs if i.kind != "user_input"]
    assert names == [(i.kind, i.name) for i in wrapped.inputs if i.kind != "user_input"]


@pytest.mark.slow
def test_a_model_with_a_tensor_constant_trains_with_a_loss_fn_on_two_ranks_like_one_process():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(4, 8), torch.randn(4, 4)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    cluster = Cluster.local(world_size=2)
    compiled = compile(model, cluster, plan=baselines.megatron(model, cluster, tp=2, **kw), **kw)
    assert "c_scale" in compiled.code(0)
    ref = one_process(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer="sgd", lr=0.05)
    losses, params = run_distributed(compiled, inputs=(x,), target=y, steps=3, optimizer="sgd", lr=0.05,
                                     return_parameters=True)
    assert ref.losses[-1] < ref.losses[0]  # it trained
    ref.check(losses, params)
