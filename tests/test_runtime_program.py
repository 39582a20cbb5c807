"""DistributedProgram without processes: where weights come from, what it refuses, pickling."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from autopar.core.errors import AutoparError, CodegenError
from autopar.core.placement import Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import loss_of
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids)).logsumexp(-1).mean()


@pytest.fixture(scope="module")
def tied():
    model = Tied()
    cap = capture(model, (torch.randint(0, 16, (4, 3)),))
    return model, cap, propagate(cap.graph_module, (2,), {"ids": (Shard(0),)})


def test_weights_come_from_a_model_or_a_state_dict_keyed_by_fqn(tied):
    model, cap, assignment = tied
    with pytest.raises(CodegenError, match="exactly one of model= or state_dict="):
        DistributedProgram(cap, assignment)
    with pytest.raises(CodegenError, match="no tensor for parameter 'emb.weight'"):
        DistributedProgram(cap, assignment, state_dict={})
    from_sd = DistributedProgram(cap, assignment, state_dict=model.state_dict())
    from_model = DistributedProgram(cap, assignment, model=model)
    assert from_sd.code(0) == from_model.code(0)
    # the tied weight is one stored tensor (and one placeholder)
    assert from_model.describe_storage() == "emb.weight: R"


def test_a_program_pickles_with_its_emitted_code(tied):
    model, cap, assignment = tied
    program = DistributedProgram(cap, assignment, model=model)
    clone = pickle.loads(pickle.dumps(program))
    assert [clone.code(r) for r in range(2)] == [program.code(r) for r in range(2)]


def test_running_needs_an_initialised_process_group(tied):
    model, cap, assignment = tied
    program = DistributedProgram(cap, assignment, model=model)
    with pytest.raises(AutoparError, match="init_process_group"):
        program.module()


def test_loss_of_finds_scalars_attributes_and_tuples():
    loss = torch.tensor(2.0)
    assert loss_of(loss) is loss
    assert loss_of((loss, torch.ones(3))) is loss
    assert loss_of(type("Out", (), {"loss": loss})()) is loss
    with pytest.raises(AutoparError, match="cannot find the loss"):
        loss_of(torch.ones(3))
