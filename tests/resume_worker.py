"""A training job for torchrun that checkpoints every step and resumes from the newest checkpoint.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/resume_worker.py PLAN.json CKPT_DIR LOSSES.txt STEPS KILL_AT

Each step trains on batch ``batch(step)`` and saves ``CKPT_DIR/step-NNNNN``; rank 0 then appends
``restart step loss`` to LOSSES.txt. With KILL_AT > 0, rank 1 of the first attempt kills itself
(SIGKILL) in the middle of step KILL_AT, after its forward and backward and before the save:
torchrun restarts every rank, and the new ranks resume from the last complete checkpoint. At the
end rank 0 writes the gathered parameters to LOSSES.txt + ".final.pt".
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from models import mlp

WIDTH, HIDDEN, BATCH = 64, 256, 4


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return mlp(WIDTH, HIDDEN)


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2)


def init_process_group():
    """gloo with this attempt's keys under their own prefix in torchrun's store: with the plain
    ``init_process_group("gloo")`` a restarted rank sometimes read the address a killed rank of
    the previous attempt had published and failed to connect (torch 2.13, c10d rendezvous)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, multi_tenant=not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"autopar-attempt-{attempt}", store),
                            rank=rank, world_size=world)


def main(plan_file, ckpt_dir, log_file, steps, kill_at):
    from autopar import Cluster
    from autopar.compile import compile
    from autopar.plan import Plan
    from autopar.runtime import checkpoint

    torch.set_num_threads(1)
    init_process_group()
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    plan = Plan.load(plan_file)
    x, y = batch(0)
    cluster = Cluster.local(world_size=dist.get_world_size()).with_mesh(plan.mesh_shape)
    compiled = compile(build_model(), cluster, example_inputs=(x,), example_target=y,
                       loss_fn=F.mse_loss, plan=plan)
    program = compiled.runner()
    opt = make_optimizer(program.parameters())
    last = checkpoint.latest(ckpt_dir)
    done = checkpoint.load(compiled, last, optimizer=opt) if last else 0
    for step in range(done + 1, steps + 1):
        x, y = batch(step)
        opt.zero_grad()
        loss = program.step((x,), y)
        if attempt == 0 and step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step: this step is not completed
        opt.step()
        checkpoint.save(compiled, os.path.join(ckpt_dir, f"step-{step:05d}"), optimizer=opt, step=step)
        if rank == 0:
            with open(log_file, "a") as f:
                f.write(f"{attempt} {step} {float(loss)!r}\n")
    state = program.full_state_dict()
    if rank == 0:
        torch.save(state, log_file + ".final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    plan_file, ckpt_dir, log_file, steps, kill_at = sys.argv[1:6]
    main(plan_file, ckpt_dir, log_file, int(steps), int(kill_at))
