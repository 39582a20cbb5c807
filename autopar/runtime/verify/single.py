"""One rank of a one-program plan (:class:`~autopar.runtime.program.DistributedProgram`) run for
one training step on fake tensors (:mod:`autopar.runtime.verify.fake`)."""

from __future__ import annotations

import time

import torch

from autopar.comm.buckets import reset_pending, wait_outputs
from autopar.comm.mesh import rank_mesh
from autopar.core.precision import Precision
from autopar.runtime.program import DistributedModule, DistributedProgram
from autopar.runtime.verify.fake import (
    CPU,
    fake_mode,
    fake_program_values,
    fake_shard,
    fake_world,
    make_optimizer,
    stepped,
    watching,
)
from autopar.runtime.verify.measured import Measured, measured


def captured_value(captured, name: str):
    """The value placeholder ``name`` of ``captured``'s graph was traced with (a non-tensor input)."""
    return next(n.meta.get("val") for n in captured.graph_module.graph.nodes if n.name == name)


def measure_rank(program: DistributedProgram, captured, rank: int, *, optimizer: str,
                 precision: Precision) -> Measured:
    """Rank ``rank``'s step of ``program`` (``captured``: its graph, for the inputs' shapes), its
    floating tensors in ``precision``'s compute dtype."""
    start = time.perf_counter()
    mesh_shape = tuple(program.mesh_shape)
    metas = {inp.node: inp.meta for inp in captured.inputs}
    with fake_world(rank, program.assignment.world_size):
        mesh = rank_mesh(mesh_shape)
        axes = {name: axis for axis, name in enumerate(mesh.group_names) if name is not None}
        gm = program.emit(rank)
        with fake_mode():
            values, masters = fake_program_values(program._stored, program._weights, mesh_shape, precision,
                                                  host=program.host, parameters=program.offload_parameters)
            module = DistributedModule(gm, mesh, program._stored, values, program._mutations,
                                       recompute=program.recompute, fetch=program.fetched(gm, values, CPU),
                                       checkpoints=program.checkpoint_host)
            if program.zero:
                masters = program.zero_shards(module, masters, mesh)
            inputs = [fake_shard(metas[u.node].shape, precision.dtype(metas[u.node].dtype), u.sharding, mesh_shape)
                      if metas[u.node] is not None else captured_value(captured, u.node)  # a flag (CLIP's return_loss)
                      for u in program._inputs]
            opt = make_optimizer(stepped(module, masters), optimizer)
            feed = iter(inputs)
            args = [module.stored(program._stored[i].fqn) if kind == "stored" else next(feed)
                    for kind, i in program._placeholders]
            reset_pending()
            with watching(axes, opt, tracked=values + stepped(module, masters),
                          inputs=[x for x in inputs if isinstance(x, torch.Tensor)],
                          host=program.host or program.checkpoint_host) as watch:
                outputs = module(*args, wait=False)
                watch.set_phase("backward")
                outputs[program._loss_index].backward()
                wait_outputs()
                module.apply_mutations(outputs)
                watch.set_phase("optimizer")
                watch.memory.mark_gradients(p.grad for p in module.parameters() if p.grad is not None)
                if masters is not None:
                    masters.take_gradients(module.stored)
                opt.step()
                if program.zero:  # the updated shards gathered: the step's last collectives
                    masters.refresh(module.stored, changed_only=False)
            return measured(watch, module, opt, rank=rank, stage=None, seconds=time.perf_counter() - start,
                            masters=masters)


__all__ = ["measure_rank"]
