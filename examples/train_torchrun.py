"""Train with a saved plan under torchrun: every rank loads the same plan.json and runs its part.

    python examples/train_torchrun.py --plan-only plan.json        # make the plan (no GPUs needed)
    torchrun --nproc-per-node 2 examples/train_torchrun.py plan.json

The model here is a tiny LLaMA (grouped-query attention) from autopar.zoo, planned for the
local CPU ranks (gloo); on GPUs use Cluster.preset(...) and NCCL the same way. Rank 0 prints
the loss of each step; every rank trains only its own shards of the parameters.
"""

import argparse

import torch
import torch.distributed as dist

import autopar
from autopar import zoo

STEPS = 5


def build():
    model, (args, kwargs) = zoo.llama(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=16, batch=8)
    return model, {"input_ids": args[0], **kwargs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan", help="plan file (written with --plan-only, read by every rank)")
    parser.add_argument("--plan-only", action="store_true", help="plan for 2 local ranks and save")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    model, example = build()  # same seed on every rank: same weights, same batch
    if args.plan_only:
        cluster = autopar.Cluster.local(world_size=args.world_size)
        autopar.compile(model, cluster, example_inputs=example).plan.save(args.plan)
        print(f"saved {args.plan}")
        return
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    plan = autopar.Plan.load(args.plan)
    cluster = autopar.Cluster.local(world_size=dist.get_world_size())
    compiled = autopar.compile(model, cluster, example_inputs=example, plan=plan)
    runner = compiled.runner()
    optimizer = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = runner.step(example)  # the global batch: each rank takes its slice; a 0-dim tensor
        runner.optimizer_step(optimizer)  # optimizer.step(); under fp16 it skips overflowed steps
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.6f}")  # reading the value waits for the step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
