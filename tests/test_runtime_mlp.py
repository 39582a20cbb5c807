"""A 2-layer MLP trained on local gloo ranks equals the same model trained in one process.

Each test spawns its ranks once and trains with SGD and then AdamW from the same initial
weights; losses and final parameters must match the unmodified model (:mod:`one_process`: SGD at
fp32, rtol 1e-5 / atol 1e-6; AdamW against float64 within fp32's measured noise).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.testing import run_distributed
from autopar.zoo import MLP
from one_process import one_process

pytestmark = pytest.mark.slow  # rank processes

R, S0, S1 = Replicate(), Shard(0), Shard(1)
PARAMS = ("p_fc1_weight", "p_fc1_bias", "p_fc2_weight", "p_fc2_bias")
OPTIMIZERS = ("sgd", "adamw")
LR = 0.05


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = MLP(8, 16, 4)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    wrapped = WithLoss(model, F.mse_loss)
    refs = [one_process(model, inputs=(x,), target=y, loss_fn=F.mse_loss, steps=3, optimizer=opt, lr=LR)
            for opt in OPTIMIZERS]
    return model, wrapped, capture(wrapped, (x, y)), x, y, refs


def _check(setup, program):
    _, _, _, x, y, refs = setup
    got = run_distributed(program, inputs=(x,), target=y, steps=3, optimizer=list(OPTIMIZERS), lr=LR,
                          return_parameters=True)
    for opt, (losses, params), ref in zip(OPTIMIZERS, got, refs):
        assert ref.losses[-1] < ref.losses[0]  # it trained
        assert set(params) == set(ref.params)
        ref.check(losses, params, where=opt)


def test_data_parallel_on_two_ranks_matches_one_process(setup):
    _, wrapped, cap, *_ = setup
    assignment = propagate(cap.graph_module, (2,), {"args_0": (S0,), "args_1": (S0,)})
    _check(setup, DistributedProgram(cap, assignment, model=wrapped))


def test_megatron_tensor_parallel_on_two_ranks_matches_one_process(setup):
    _, wrapped, cap, *_ = setup
    holders = {"p_fc1_weight": (S0,), "p_fc1_bias": (S0,), "p_fc2_weight": (S1,)}
    assignment = propagate(cap.graph_module, (2,), holders)
    assert assignment.node_strategies["linear_1"].outputs == ((Partial(),),)
    _check(setup, DistributedProgram(cap, assignment, model=wrapped))


def test_fsdp_parameters_gathered_on_use_on_two_ranks_match_one_process(setup):
    _, wrapped, cap, *_ = setup
    dp = propagate(cap.graph_module, (2,), {"args_0": (S0,), "args_1": (S0,)})
    holders = {"args_0": (S0,), "args_1": (S0,), **{p: (S0,) for p in PARAMS}}
    assignment = propagate(cap.graph_module, (2,), holders, node_strategies=dp.node_strategies)
    program = DistributedProgram(cap, assignment, model=wrapped)
    assert program.code().count("backward = 'reduce_scatter'") == len(PARAMS)
    _check(setup, program)


def test_data_and_tensor_parallel_on_a_2x2_mesh_match_one_process(setup):
    _, wrapped, cap, *_ = setup
    holders = {"args_0": (S0, R), "args_1": (S0, R), "p_fc1_weight": (R, S0), "p_fc1_bias": (R, S0),
               "p_fc2_weight": (R, S1)}
    assignment = propagate(cap.graph_module, (2, 2), holders)
    _check(setup, DistributedProgram(cap, assignment, model=wrapped))
