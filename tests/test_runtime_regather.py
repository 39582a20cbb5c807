"""ZeRO-3/FSDP: a sharded parameter is gathered in forward and gathered again in backward.

The gathered copy is not kept for backward (what the cost model assumes): autograd holds no
whole weight between forward and backward, backward gathers again each weight it uses, and the
loss and gradients still equal one process's. A parameter sharded on both mesh axes is gathered
back through both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import autopar
from autopar import Cluster, baselines
from autopar.comm import regather
from autopar.comm.buckets import wait_outputs
from autopar.testing import run_on_ranks
from autopar.zoo import MLP

pytestmark = pytest.mark.slow  # rank processes


def _program(world, mesh_shape):
    torch.manual_seed(0)
    model = MLP(8, 16, 8)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    cluster = Cluster.local(world).with_mesh(mesh_shape)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    compiled = autopar.compile(model, cluster, plan=baselines.fsdp(model, cluster, **kw), **kw)
    return model, x, y, compiled.program


def _step_counting_gathers(program, x, y):
    program.step((x,), y)  # builds the module outside the counts
    for p in program.parameters():
        p.grad = None
    gathered, kept = [], []
    real_gather, real_pack = dist.all_gather_single, regather._pack

    def gather(out, src, *args, **kwargs):
        gathered.append(out.numel())
        return real_gather(out, src, *args, **kwargs)

    def pack(t):  # what autograd keeps from forward to backward
        packed = real_pack(t)
        if isinstance(packed, torch.Tensor):
            kept.append(packed.numel())
        return packed

    dist.all_gather_single, regather._pack = gather, pack
    try:
        outputs = program.forward((x,), y, wait=False)
        forward_gathers = list(gathered)
        outputs[0].backward()
        wait_outputs()
    finally:
        dist.all_gather_single, regather._pack = real_gather, real_pack
    return gathered, forward_gathers, kept, float(outputs[0].detach()), program.full_gradients()


@pytest.mark.parametrize("world, mesh_shape", [(2, (2,)), (4, (2, 2))])
def test_sharded_parameters_are_gathered_again_in_backward(world, mesh_shape):
    model, x, y, program = _program(world, mesh_shape)
    (gathered, forward_gathers, kept, loss, grads), *_ = run_on_ranks(
        _step_counting_gathers, world_size=world, args=(program, x, y))
    assert len(forward_gathers) == 4 * len(mesh_shape)  # one per parameter and axis
    # backward gathers again what it uses: fc2's weight (fc1's input needs no gradient, so
    # autograd saved no fc1 weight, and biases are never saved), through the same axes
    k = len(mesh_shape)
    assert gathered[len(forward_gathers):] == forward_gathers[2 * k:3 * k]
    whole = {p.numel() for name, p in model.named_parameters() if name.endswith("weight")}  # {128}
    assert kept and not whole & set(kept), "autograd kept a whole weight from forward to backward"
    model.zero_grad()
    want = F.mse_loss(model(x), y)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
