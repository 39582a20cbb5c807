"""Step time of autopar's emitted programs against PyTorch's own parallel wrappers, 2 gloo ranks.

For an MLP and a transformer block (pre-LN, causal attention, 4x MLP), on 2 gloo ranks of one
thread each:

- data parallel: autopar's ``data_parallel`` plan, emitted and run, against
  ``torch.nn.parallel.DistributedDataParallel`` (each rank: its half of the batch);
- Megatron: autopar's ``megatron(tp=2)`` plan against ``torch.distributed.tensor.parallel``
  (q/k/v and fc1 ``ColwiseParallel``, the attention output and fc2 ``RowwiseParallel``).

A step is zero_grad, forward, MSE loss, backward and an SGD step; autopar's step also returns
the global loss as a float (DDP's does not all-reduce its loss). All runners of a model are
timed in the same processes, interleaved round by round (:mod:`steptiming`); each round is the
slower rank's time. Each comparison (autopar's step and torch's) is timed in its own
interleaved rounds: with all four runners in one rotation each runner always followed the same
other one, and a TP step's after-effects (its threads, freed memory) fell on one side only.
Printed: median and lower quartile per runner, and the ratios autopar / torch of the medians,
of the lower quartiles and per round (paired). Run::

    python benchmarks/runtime_vs_torch.py --runs 3 --rounds 40
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings

import torch
import torch.distributed as dist
from steptiming import interleaved, ratios, summary
from torch import nn
from torch.nn import functional as F

import autopar
from autopar.testing import run_on_ranks


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """A GPT-style block; the head count is inferred from the width of q (so that a
    column-parallel q/k/v under torch TP runs its local heads unchanged)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


TP_LAYOUT = {
    "mlp": {"fc1": "col", "fc2": "row"},
    "block": {"q": "col", "k": "col", "v": "col", "o": "row", "fc1": "col", "fc2": "row"},
}


def _programs(model, x, y):
    """autopar's data-parallel and Megatron (tp=2) programs of ``model`` with an MSE loss."""
    cluster = autopar.Cluster.local(2)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    out = {}
    for name, plan in (("dp", autopar.baselines.data_parallel(model, cluster, **kw)),
                       ("tp", autopar.baselines.megatron(model, cluster, tp=2, **kw))):
        out[name] = autopar.compile(model, cluster, plan=plan, **kw).program
    return out


def _bench(cases, warmup, rounds, lr=1e-3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for name, model, x, y, programs in cases:
        half = slice(rank * x.shape[0] // 2, (rank + 1) * x.shape[0] // 2)
        runners = {}
        for kind, program in programs.items():
            opt = torch.optim.SGD(program.parameters(), lr=lr)

            def ours(program=program, opt=opt):
                opt.zero_grad()
                program.step((x,), y)
                opt.step()
            runners[f"autopar {kind}"] = ours

        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        tp = parallelize_module(copy.deepcopy(model), mesh, {
            k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_LAYOUT[name].items()})
        for label, module, xs, ys in (("DDP", ddp, x[half], y[half]), ("torch TP", tp, x, y)):
            opt = torch.optim.SGD(module.parameters(), lr=lr)

            def theirs(module=module, opt=opt, xs=xs, ys=ys):
                opt.zero_grad()
                F.mse_loss(module(xs), ys).backward()
                opt.step()
            runners[label] = theirs
        results[name] = {}
        for ours, theirs in PAIRS:  # each pair in its own rounds: no third runner's after-effects
            results[name].update(interleaved({k: runners[k] for k in (ours, theirs)},
                                              warmup=warmup, rounds=rounds))
    return results


PAIRS = (("autopar dp", "DDP"), ("autopar tp", "torch TP"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256, help="MLP input/output width")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=64, help="MLP batch")
    parser.add_argument("--block-d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds per run")
    parser.add_argument("--runs", type=int, default=3,
                        help="independent runs, each on freshly spawned ranks (a run's thread placement"
                             " biases it as a whole; the runs' median ratio cancels that)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cases = []
    mlp = MLP(args.d, args.hidden)
    x, y = torch.randn(args.batch, args.d), torch.randn(args.batch, args.d)
    cases.append(("mlp", mlp, x, y, _programs(mlp, x, y)))
    block = Block(args.block_d, args.heads)
    x = torch.randn(args.block_batch, args.seq, args.block_d)
    y = torch.randn(args.block_batch, args.seq, args.block_d)
    cases.append(("block", block, x, y, _programs(block, x, y)))
    runs = [run_on_ranks(_bench, world_size=2, timeout=1200, args=(cases, args.warmup, args.rounds))[0]
            for _ in range(args.runs)]
    print(f"2 gloo ranks x 1 thread; {args.runs} runs x {args.rounds} interleaved rounds after"
          f" {args.warmup} warm-up; ms of the slower rank, rounds of all runs pooled")
    print(f"  mlp:   {args.d}->{args.hidden}->{args.d}, batch {args.batch}")
    print(f"  block: d {args.block_d}, {args.heads} heads, batch {args.block_batch} x seq {args.seq}")
    print(f"{'model':6s} {'autopar vs torch':24s} {'autopar med / lq':>17s} {'torch med / lq':>17s}"
          f" {'ratio med':>9s} {'lq':>5s} {'paired':>6s}  {'ratio med per run':s}")
    for name in runs[0]:
        for kind, label, ref in (("dp", "data parallel vs DDP", "DDP"), ("tp", "Megatron vs torch TP", "torch TP")):
            a = [t for run in runs for t in run[name][f"autopar {kind}"]]
            b = [t for run in runs for t in run[name][ref]]
            (am, al), (bm, bl) = summary(a), summary(b)
            rm, rl, rp = ratios(a, b)
            per_run = [ratios(run[name][f"autopar {kind}"], run[name][ref])[0] for run in runs]
            print(f"{name:6s} {label:24s} {am * 1e3:8.2f} /{al * 1e3:7.2f} {bm * 1e3:8.2f} /{bl * 1e3:7.2f}"
                  f" {rm:9.2f} {rl:5.2f} {rp:6.2f}  {' '.join(f'{r:.2f}' for r in per_run)}"
                  f" (median {statistics.median(per_run):.2f})")

if __name__ == "__main__":
    main()
