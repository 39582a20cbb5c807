"""BatchNorm in training mode on two gloo ranks: the running statistics the graph returns are
written back into the buffers, and everything equals the model trained in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopar.core.placement import Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.testing import run_distributed, run_reference

pytestmark = pytest.mark.slow  # rank processes


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_batchnorm_running_statistics_match_one_process_under_data_parallel():
    torch.manual_seed(0)
    model = BNNet().train()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    wrapped = WithLoss(model, F.mse_loss)
    cap = capture(wrapped, (x, y))
    assert [o.name for o in cap.outputs if o.kind == "buffer_mutation"] == [
        "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assignment = propagate(cap.graph_module, (2,), {"args_0": (Shard(0),), "args_1": (Shard(0),)})
    program = DistributedProgram(cap, assignment, model=wrapped)
    losses, state = run_distributed(program, inputs=(x,), target=y, steps=3, optimizer="sgd", lr=0.1,
                                    return_parameters=True)
    ref_losses, ref_state = run_reference(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3,
                                          optimizer="sgd", lr=0.1, return_parameters=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert int(state["bn.num_batches_tracked"]) == 3
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(ref_state["bn.running_mean"], torch.zeros(16))  # they did move
