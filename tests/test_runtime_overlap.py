"""The data-parallel step overlaps its gradient sums with the backward pass, as DDP does.

- a parameter's ``autopar_grad_all_reduce`` is emitted just before the parameter's first use
  (autograd runs it as soon as that gradient is complete, not after the whole backward pass);
- on two ranks a step issues one all-reduce per gradient bucket and none besides: the loss's
  sum rides in the last bucket; the loss and gradients still equal one process's, and a
  forward without backward still returns the summed loss;
- on a 2 x 2 mesh, batch split on both axes, each gradient is summed over both axes, and two
  steps without ``zero_grad`` accumulate exactly as one process does;
- under ``deferred_gradient_sums()`` (a pipeline step) two backward passes send their gradients
  once, summed, when the step ends.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopar.comm.buckets import deferred_gradient_sums
from autopar.core.placement import Shard
from autopar.passes.capture import capture
from autopar.passes.capture.loss import WithLoss
from autopar.planner.propagate import propagate
from autopar.runtime import DistributedProgram
from autopar.testing import run_on_ranks
from autopar.zoo import MLP


def _program(mesh_shape=(2,), rows=6):
    torch.manual_seed(0)
    model = WithLoss(MLP(8, 16, 8), F.mse_loss)
    x, y = torch.randn(rows, 8), torch.randn(rows, 8)
    cap = capture(model, (x, y))
    split = (Shard(0),) * len(mesh_shape)
    dp = propagate(cap.graph_module, mesh_shape, {"args_0": split, "args_1": split})
    return model, x, y, DistributedProgram(cap, dp, model=model)


def test_parameter_gradient_sums_are_emitted_just_before_first_use():
    *_, program = _program()
    order = [line.split(" = ")[0].strip() for line in program.code(0).splitlines() if " = " in line]
    assert order[:7] == [
        "p_fc1_weight_grad_all_reduce", "p_fc1_bias_grad_all_reduce", "linear", "relu",
        "p_fc2_weight_grad_all_reduce", "p_fc2_bias_grad_all_reduce", "linear_1",
    ]


@contextlib.contextmanager
def _all_reduce_sizes():
    """The element counts of the all-reduces the runtime issues inside the block."""
    calls, real = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = real


def _warm_up(program, x, y):
    """One step outside the counts (builds the module and its hooks; buckets form the same way
    every step), then no gradients."""
    program.step((x,), y)
    for p in program.parameters():
        p.grad = None


def _count_step(program, x, y):
    _warm_up(program, x, y)
    with _all_reduce_sizes() as calls:
        loss = program.step((x,), y)
    grads = program.full_gradients()
    with torch.no_grad():  # no backward: the deferred loss sum is sent when the outputs are read
        (forward_loss,) = program.forward((x,), y)
    return calls, float(loss), grads, float(forward_loss)


@pytest.mark.slow
def test_a_data_parallel_step_sends_only_its_gradient_buckets():
    model, x, y, program = _program()
    (calls, loss, grads, forward_loss), _ = run_on_ranks(_count_step, world_size=2, args=(program, x, y))
    n_params = sum(p.numel() for p in model.parameters())
    assert calls == [n_params + 1]  # one bucket (under 1 MiB): every gradient and the loss
    model.zero_grad()
    want = F.mse_loss(model._model(x), y)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    assert forward_loss == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


def _accumulate_two_steps(program, batches):
    losses = [program.step((x,), y) for x, y in batches]  # no zero_grad in between
    return torch.stack(losses).tolist(), program.full_gradients()


@pytest.mark.slow
def test_two_axis_gradient_sums_accumulate_like_one_process():
    model, x, y, program = _program((2, 2), rows=8)
    assert program.code(0).count("_grad_all_reduce(") == 8  # 4 parameters x 2 axes
    batches = [(x, y), (y, x)]
    (losses, grads), *_ = run_on_ranks(_accumulate_two_steps, world_size=4, args=(program, batches))
    model.zero_grad()
    want = [F.mse_loss(model._model(a), b) for a, b in batches]
    for loss in want:
        loss.backward()
    assert losses == pytest.approx([w.item() for w in want], rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


def _two_passes_deferred(program, batches):
    _warm_up(program, *batches[0])
    with _all_reduce_sizes() as calls:
        with deferred_gradient_sums():  # two backward passes, as a pipeline's micro-batches
            for x, y in batches:
                (loss,) = program.forward((x,), y)
                loss.backward()
            during = list(calls)
    return during, calls, program.full_gradients()


@pytest.mark.slow
def test_deferred_gradient_sums_send_one_bucket_per_step():
    model, x, y, program = _program()
    batches = [(x, y), (y, x)]
    (during, calls, grads), _ = run_on_ranks(_two_passes_deferred, world_size=2, args=(program, batches))
    n_params = sum(p.numel() for p in model.parameters())
    assert calls.count(n_params) == 1 and n_params not in during  # once, when the step ends
    model.zero_grad()
    for a, b in batches:
        F.mse_loss(model._model(a), b).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
