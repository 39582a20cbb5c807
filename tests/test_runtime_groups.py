"""autopar holds no process group once the user destroys them (:mod:`autopar.comm.groups`).

A ProcessGroup kept past ``destroy_process_group()`` keeps gloo's worker threads running into
interpreter shutdown; a worker releasing a just-finished collective then needs the GIL, the
finalizing interpreter ends the thread, and the process aborts with "terminate called without an
active exception" (a core dump of the torchrun resume test showed exactly that: the main thread
in ``Py_FinalizeEx``'s garbage collection, a ``ProcessGroupGloo::runLoop`` thread destroying an
``AsyncAllgatherWork`` whose tensor's Python object it could no longer decref). On 2 ranks: a
sharded program trains, gathers its full state, saves and loads a checkpoint, a pipelined program
trains; then, with the groups destroyed, no live
Python object refers to a ProcessGroup, and the default group's name no longer resolves.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroup
from torch.nn import functional as F

from autopar import Cluster, baselines
from autopar.compile import compile
from autopar.runtime import checkpoint
from autopar.testing import run_on_ranks
from models import ResidualStack

pytestmark = pytest.mark.slow  # rank processes


def _holders_of_groups() -> list[str]:
    """Types of the live objects that refer to a ProcessGroup."""
    gc.collect()
    return sorted({type(o).__name__ for o in gc.get_objects()
                   if any(isinstance(r, ProcessGroup) for r in gc.get_referents(o))})


def _train_save_load_destroy(fsdp, pipe, x, y, path):
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    for program in (fsdp, pipe):
        program.step((x,), y)
        program.full_state_dict()
    opt.step()
    checkpoint.save(fsdp, path, optimizer=opt, step=1)
    checkpoint.load(fsdp, path)
    before = _holders_of_groups()
    world = dist.group.WORLD.group_name
    dist.destroy_process_group()
    try:
        dist.distributed_c10d._resolve_process_group(world)
        resolved = True
    except RuntimeError:
        resolved = False
    return before, _holders_of_groups(), resolved


def test_no_process_group_outlives_destroy_process_group(tmp_path):
    torch.manual_seed(0)
    model = ResidualStack(4, 8)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kw = dict(example_inputs=(x,), example_target=y, loss_fn=F.mse_loss)
    local = Cluster.local(world_size=2)
    fsdp = compile(model, local, plan=baselines.fsdp(model, local, **kw), **kw)
    pipe_plan = baselines.megatron(model, local, tp=1, pp=2, micro_batches=2, **kw)
    pipe = compile(model, local.with_mesh(pipe_plan.mesh_shape), plan=pipe_plan, **kw)
    assert pipe.plan.stages and fsdp.plan.parameter_placements["blocks.0.fc.weight"] == ("S(0)",)
    for before, after, resolved in run_on_ranks(_train_save_load_destroy, world_size=2,
                                                args=(fsdp.program, pipe.program, x, y, str(tmp_path / "ckpt"))):
        assert before  # the scan sees groups while they are alive (torch's registry holds them)
        assert after == [] and not resolved
