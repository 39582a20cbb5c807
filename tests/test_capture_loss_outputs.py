"""The model's own loss found anywhere in its output (tuple, dict, dataclass), by capture and by
the runtime's loss_of alike, and a GPT returning (logits, loss) training on two ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.core.errors import AutoparError, InputError
from autopar.passes.capture.loss import loss_of
from autopar.passes.capture.training import capture_for_training
from autopar.testing import run_distributed
from models import TinyTransformer
from one_process import one_process


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    aux: dict
    loss: torch.Tensor


class Returns(nn.Module):
    """A linear model whose forward returns its loss inside ``shape(logits, loss)``."""

    def __init__(self, shape):
        super().__init__()
        self.fc, self.shape = nn.Linear(4, 3), shape

    def forward(self, x, y):
        logits = self.fc(x)
        return self.shape(logits, F.cross_entropy(logits, y))


SHAPES = {
    "tuple (logits, loss)": (lambda lg, ls: (lg, ls), "[1]"),
    "nested tuple": (lambda lg, ls: (lg, (lg.sum(-1), ls)), "[1][1]"),
    "dict": (lambda lg, ls: {"logits": lg, "loss": ls}, "loss"),
    "dataclass with a scalar aux": (lambda lg, ls: Result(lg, {"z": lg.square().mean()}, ls), "loss"),
    "(loss, aux scalar)": (lambda lg, ls: (ls, lg.mean()), "[0]"),
}


@pytest.mark.parametrize("name", SHAPES)
def test_capture_and_loss_of_find_the_same_loss(name):
    shape, where = SHAPES[name]
    model, x, y = Returns(shape), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    cap = capture_for_training(model, example_inputs=(x, y))
    assert [o.name for o in cap.outputs if o.kind == "loss"] == [where]
    assert torch.equal(loss_of(model(x, y)), F.cross_entropy(model.fc(x), y))


def test_an_output_with_no_loss_or_two_unnamed_scalars_is_refused_by_both():
    two = Returns(lambda lg, ls: (lg, ls, lg.mean()))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    with pytest.raises(InputError, match="holds no loss"):
        capture_for_training(two, example_inputs=(x, y))
    with pytest.raises(AutoparError, match="cannot find the loss.*named 'loss'"):
        loss_of(two(x, y))
    with pytest.raises(AutoparError, match="cannot find the loss"):
        loss_of({"logits": torch.ones(3), "count": torch.tensor(3)})  # 0-dim but not floating


class GPT(TinyTransformer):
    """nanoGPT's interface: forward(idx, targets) returns (logits, loss)."""

    def forward(self, ids, labels):
        return self.head(self.emb(ids)), super().forward(ids, labels)


@pytest.mark.slow
def test_a_gpt_returning_logits_and_loss_trains_on_two_ranks_like_one_process():
    torch.manual_seed(0)
    model = GPT()
    ids, labels = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    cluster = Cluster.local(world_size=2)
    plan = baselines.megatron(model, cluster, example_inputs=(ids, labels), tp=2)
    compiled = compile(model, cluster, example_inputs=(ids, labels), plan=plan)
    ref = one_process(model, inputs=(ids, labels), steps=3, optimizer="sgd", lr=0.1)
    losses, params = run_distributed(compiled, inputs=(ids, labels), steps=3, optimizer="sgd", lr=0.1,
                                     return_parameters=True)
    assert ref.losses[-1] < ref.losses[0]
    ref.check(losses, params)
