"""Code generation for a 2-layer MLP: the emitted programs, read as text (no processes)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from torch.nn import functional as F

from autopar import Cluster
from autopar.compile import compile
from autopar.core.assignment import ShardingAssignment
from autopar.core.errors import CodegenError, ShardingError
from autopar.core.ir import Strategy
from autopar.core.placement import Partial, Replicate, Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss
from autopar.passes.codegen import CodegenContext, generate
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.runtime.graphio import pack, unpack
from autopar.zoo import MLP

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
PARAMS = ("p_fc1_weight", "p_fc1_bias", "p_fc2_weight", "p_fc2_bias")


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = WithLoss(MLP(8, 16, 4), F.mse_loss)
    return model, capture(model, (torch.randn(4, 8), torch.randn(4, 4)))


def _program(mlp, holders, mesh=(2,), **kw):
    model, cap = mlp
    return DistributedProgram(cap, propagate(cap.graph_module, mesh, holders, **kw), model=model)


def _replicated_loss(mesh=(2,)):
    """Force the loss tail (broadcast, MSE) replicated, as Megatron computes it."""
    r = (R,) * len(mesh)
    return {"broadcast_tensors": Strategy((r, r), (r, r)), "mse_loss": Strategy((r, r), (r,))}


MEGATRON_RANK0 = """
def forward(self, p_fc1_weight, p_fc1_bias, p_fc2_weight, p_fc2_bias, args_0, args_1):
    linear = torch.ops.aten.linear.default(args_0, p_fc1_weight, p_fc1_bias);  args_0 = p_fc1_weight = p_fc1_bias = None
    relu = torch.ops.aten.relu.default(linear);  linear = None
    p_fc2_bias_to_partial = autopar_to_partial(p_fc2_bias, axis = 0, backward = 'identity');  p_fc2_bias = None
    linear_1 = torch.ops.aten.linear.default(relu, p_fc2_weight, p_fc2_bias_to_partial);  relu = p_fc2_weight = p_fc2_bias_to_partial = None
    linear_1_all_reduce = autopar_all_reduce(linear_1, axis = 0, backward = 'identity');  linear_1 = None
    broadcast_tensors = torch.ops.aten.broadcast_tensors.default([linear_1_all_reduce, args_1]);  linear_1_all_reduce = args_1 = None
    getitem = broadcast_tensors[0]
    getitem_1 = broadcast_tensors[1];  broadcast_tensors = None
    mse_loss = torch.ops.aten.mse_loss.default(getitem, getitem_1);  getitem = getitem_1 = None
    return (mse_loss,)
"""


def test_megatron_mlp_emits_exactly_one_forward_all_reduce(mlp):
    program = _program(mlp, {"p_fc1_weight": (S0,), "p_fc1_bias": (S0,), "p_fc2_weight": (S1,)},
                       node_strategies=_replicated_loss())
    code = program.code(rank=0)
    assert code.strip() == MEGATRON_RANK0.strip()
    # column-parallel fc1 needs no collective; row-parallel fc2 ends in the one all-reduce (g,
    # identity backward); the bias is added once (rank 0) and its gradient stays replicated
    assert code.count("autopar_all_reduce(") == 1
    assert "autopar_grad_all_reduce" not in code
    assert program.code(rank=1) == code  # the same SPMD program on every rank


def test_data_parallel_all_reduces_each_parameter_gradient_once(mlp):
    program = _program(mlp, {"args_0": (S0,), "args_1": (S0,)})
    code = program.code(rank=0)
    for name in PARAMS:
        assert code.count(f"autopar_grad_all_reduce({name}, axis = 0)") == 1
    # the batch stays split up to the loss, whose mean over the global batch is a pending sum;
    # that scalar is the forward's one all-reduce, left in flight while the backward runs
    assert "all_gather" not in code
    assert re.findall(r"autopar_all_reduce\((\w+),.*", code) == ["mse_loss"]
    assert "wait = False" in code


def test_fsdp_gathers_parameters_and_reduce_scatters_their_gradients(mlp):
    model, cap = mlp
    dp = propagate(cap.graph_module, (2,), {"args_0": (S0,), "args_1": (S0,)})
    holders = {"args_0": (S0,), "args_1": (S0,), **{p: (S0,) for p in PARAMS}}
    program = _program(mlp, holders, node_strategies=dp.node_strategies)
    code = program.code(rank=0)
    for name in PARAMS:
        assert f"{name}_all_gather = autopar_all_gather({name}, axis = 0, dim = 0, backward = 'reduce_scatter')" in code
    assert "grad_all_reduce" not in code


def test_two_axis_mesh_reduces_on_the_tensor_axis_and_gradients_on_the_data_axis(mlp):
    holders = {"args_0": (S0, R), "args_1": (S0, R), "p_fc1_weight": (R, S0), "p_fc1_bias": (R, S0),
               "p_fc2_weight": (R, S1)}
    program = _program(mlp, holders, mesh=(2, 2), node_strategies=_replicated_loss((2, 2)))
    code = program.code(rank=3)
    assert "autopar_all_reduce(linear_1, axis = 1, backward = 'identity')" in code
    for name in PARAMS:
        assert f"autopar_grad_all_reduce({name}, axis = 0)" in code
    assert re.search(r"autopar_to_partial\(p_fc2_bias\w*, axis = 1", code)


def test_emitted_program_survives_pickling_and_packing(mlp):
    program = _program(mlp, {"args_0": (S0,), "args_1": (S0,)})
    gm = program.emit(0)
    assert unpack(pack(gm)).code == gm.code
    clone = pickle.loads(pickle.dumps(program))
    assert clone.code(rank=1) == program.code(rank=1)


def test_generate_rejects_incomplete_or_inconsistent_assignments(mlp):
    model, cap = mlp
    good = propagate(cap.graph_module, (2,), {"args_0": (S0,), "args_1": (S0,)})
    ctx = dict(rank=0, trainable=frozenset(PARAMS), loss_outputs=(0,))
    missing = ShardingAssignment(mesh_shape=(2,), node_strategies={
        k: v for k, v in good.node_strategies.items() if k != "relu"},
        placeholder_shardings=good.placeholder_shardings, output_shardings=good.output_shardings)
    with pytest.raises(CodegenError, match="no strategy for node relu"):
        generate(cap.graph_module, CodegenContext(assignment=missing, **ctx))
    partial_loss = ShardingAssignment(mesh_shape=(2,), node_strategies=good.node_strategies,
                                      placeholder_shardings=good.placeholder_shardings,
                                      output_shardings=((P,),))
    with pytest.raises(CodegenError, match="loss must be replicated"):
        generate(cap.graph_module, CodegenContext(assignment=partial_loss, **ctx))
    wrong = dict(good.node_strategies, relu=Strategy(((S0,), (S0,)), ((S0,),)))
    bad = ShardingAssignment(mesh_shape=(2,), node_strategies=wrong,
                             placeholder_shardings=good.placeholder_shardings,
                             output_shardings=good.output_shardings)
    with pytest.raises(CodegenError, match="relu .* has 1 tensor inputs"):
        generate(cap.graph_module, CodegenContext(assignment=bad, **ctx))
    with pytest.raises(CodegenError, match="rank 2 is outside"):
        CodegenContext(assignment=good, rank=2)


def test_assignment_validates_its_shardings():
    with pytest.raises(ShardingError, match="pending sums"):
        ShardingAssignment(mesh_shape=(2,), node_strategies={}, placeholder_shardings={"w": (P,)},
                           output_shardings=())
    with pytest.raises(ShardingError, match="one per mesh axis"):
        ShardingAssignment(mesh_shape=(2, 2), node_strategies={}, placeholder_shardings={"w": (R,)},
                           output_shardings=())
    with pytest.raises(ShardingError, match="mesh_shape"):
        ShardingAssignment(mesh_shape=(0,), node_strategies={}, placeholder_shardings={},
                           output_shardings=())


class _Switched(torch.nn.Module):
    """An MLP whose forward takes a bool flag, as CLIP's ``return_loss`` (a constant of the trace)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(8, 16, 4)

    def forward(self, x, *, scale: bool):
        y = self.mlp(x)
        return (2 * y if scale else y).square().mean()


def test_a_non_tensor_input_is_a_constant_that_needs_no_placement():
    compiled = compile(_Switched(), Cluster.local(world_size=2),
                       example_inputs={"x": torch.randn(4, 8), "scale": True})
    assert "mul" in compiled.program.code(0)
