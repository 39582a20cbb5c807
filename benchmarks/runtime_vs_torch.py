"""Step time of autopar's emitted programs against PyTorch's own parallel wrappers, 2 gloo ranks.

Two pairs, each timed in the same processes with the steps interleaved (A, B, A, B, ...) so that
load on the machine hits both alike; the median of ``--steps`` steps after ``--warmup``:

- data parallel: the emitted program (batch ``S(0)``, parameters replicated) against
  ``torch.nn.parallel.DistributedDataParallel``;
- Megatron MLP: the emitted program (fc1 column-, fc2 row-parallel) against
  ``torch.distributed.tensor.parallel`` with ``ColwiseParallel`` / ``RowwiseParallel``.

A step is zero_grad, forward, MSE loss, backward and an SGD step. Run::

    python benchmarks/runtime_vs_torch.py --hidden 1024 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from autopar.placement import Shard
from autopar.passes.capture import capture
from autopar.passes.propagate import propagate
from autopar.runtime import DistributedProgram, WithLoss
from autopar.testing import run_on_ranks


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(step_a, step_b, warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        step_a()
        step_b()
    ta, tb = [], []
    for _ in range(steps):
        dist.barrier()
        ta.append(_timed(step_a))
        dist.barrier()
        tb.append(_timed(step_b))
    return statistics.median(ta), statistics.median(tb)


def _programs(model, x, y):
    wrapped = WithLoss(model, F.mse_loss)
    cap = capture(wrapped, (x, y))
    dp = propagate(cap.graph_module, (2,), {"args_0": (Shard(0),), "args_1": (Shard(0),)})
    tp = propagate(cap.graph_module, (2,), {"p_fc1_weight": (Shard(0),), "p_fc1_bias": (Shard(0),),
                                           "p_fc2_weight": (Shard(1),)})
    return DistributedProgram(cap, dp, model=wrapped), DistributedProgram(cap, tp, model=wrapped)


def _bench(d, hidden, batch, warmup, steps, lr=1e-3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = MLP(d, hidden)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    ours_dp, ours_tp = _programs(model, x, y)
    half = slice(rank * batch // 2, (rank + 1) * batch // 2)

    opt_dp = torch.optim.SGD(ours_dp.parameters(), lr=lr)
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=lr)

    def ours_dp_step():
        opt_dp.zero_grad()
        ours_dp.step((x,), y)
        opt_dp.step()

    def ddp_step():
        opt_ddp.zero_grad()
        F.mse_loss(ddp(x[half]), y[half]).backward()
        opt_ddp.step()

    dp_times = _interleaved(ours_dp_step, ddp_step, warmup, steps)

    opt_tp = torch.optim.SGD(ours_tp.parameters(), lr=lr)
    mesh = init_device_mesh("cpu", (2,))
    tp_model = parallelize_module(copy.deepcopy(model), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt_torch_tp = torch.optim.SGD(tp_model.parameters(), lr=lr)

    def ours_tp_step():
        opt_tp.zero_grad()
        ours_tp.step((x,), y)
        opt_tp.step()

    def torch_tp_step():
        opt_torch_tp.zero_grad()
        F.mse_loss(tp_model(x), y).backward()
        opt_torch_tp.step()

    tp_times = _interleaved(ours_tp_step, torch_tp_step, warmup, steps)
    return {"dp": dp_times, "tp": tp_times}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    results = run_on_ranks(_bench, world_size=2, timeout=600,
                           args=(args.d, args.hidden, args.batch, args.warmup, args.steps))
    print(f"MLP {args.d}->{args.hidden}->{args.d}, batch {args.batch}, 2 gloo ranks, 1 thread each,"
          f" median of {args.steps} steps (ms, slower rank)")
    for key, label, theirs in (("dp", "data parallel", "DDP"), ("tp", "Megatron MLP", "torch TP")):
        ours = max(r[key][0] for r in results) * 1e3
        ref = max(r[key][1] for r in results) * 1e3
        print(f"  {label:14s} autopar {ours:8.2f}   {theirs:8s} {ref:8.2f}   ratio {ours / ref:5.2f}")


if __name__ == "__main__":
    main()
