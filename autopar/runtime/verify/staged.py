"""One rank of a pipelined plan (:class:`~autopar.runtime.pipeline.PipelineProgram`) run for one
training step on fake tensors (:mod:`autopar.runtime.verify.fake`).

The stage is driven here without its neighbours, in the order the plan's schedule runs it
(:func:`autopar.runtime.schedule.order`: each micro-batch's forward, and its backward once
``stage.in_flight`` micro-batches are held; GPipe holds them all), with the data-parallel
gradient sums deferred to the end of the step as :meth:`PipelineProgram.step` does, a stage the
plan marks ``recompute`` recomputing its layers as the runtime runs it, and a ZeRO-1 stage
stepping its shards (:mod:`autopar.runtime.zero`). As
:func:`~autopar.runtime.schedule.run_schedule` does, the stage keeps one receive buffer per
micro-batch for each received value and for each gradient it receives; each block the rank
sends (:func:`autopar.core.crossmesh.sent_blocks`, what its ports put on the wire) is logged as a
``send_recv``.
"""

from __future__ import annotations

import math
import time

import torch

from autopar.comm.buckets import deferred_gradient_sums, reset_pending
from autopar.comm.mesh import RankMesh
from autopar.core.crossmesh import sent_blocks
from autopar.core.layout import coord_of
from autopar.core.precision import Precision
from autopar.plan.stage_records import PP_AXIS
from autopar.runtime.pipeline import PipelineProgram
from autopar.runtime.pipeline_stage import StageModule, stage_groups
from autopar.runtime.program import DistributedModule
from autopar.runtime.schedule import order
from autopar.runtime.verify.fake import (
    fake_mode,
    fake_program_values,
    fake_world,
    make_optimizer,
    stepped,
    watching,
)
from autopar.runtime.verify.measured import Measured, measured


def measure_stage_rank(program: PipelineProgram, captured, rank: int, *, optimizer: str,
                       precision: Precision) -> Measured:
    """Rank ``rank``'s step of ``program`` (``captured``: the whole-batch graph, for the inputs)."""
    start = time.perf_counter()
    plan = program.plan
    sg, position = program.stage_of(rank)
    stage = plan.stages[sg.index]
    first, last = sg.index == 0, not sg.outputs
    mesh_shape = tuple(sg.mesh_shape)
    micro = plan.micro_batches
    blocks = {"forward": [], "backward": []}
    for block in sent_blocks(program.links, sg.index, rank):
        blocks[block[0]].append(block)
    with fake_world(rank, plan.num_devices):
        axes_names = stage_groups(plan.stages, sorted(set(program._shared.values())))[0][sg.index]
        mesh = RankMesh(mesh_shape, coord_of(position, mesh_shape), axes_names)
        axes = {name: axis for axis, name in enumerate(axes_names) if name is not None}
        with fake_mode():
            values, masters = fake_program_values(sg.stored, program._weights, mesh_shape, precision)
            inner = DistributedModule(program.emit(rank), mesh, sg.stored, values, recompute=stage.recompute)
            if stage.zero == 1:
                masters = program.zero_shards(rank, inner, masters, mesh)
            module = StageModule(inner, sg, mesh, first=first, scale=program._scale)
            opt = make_optimizer(stepped(inner, masters), optimizer)
            users = [i for i in captured.inputs if i.kind == "user_input"]
            whole = [torch.empty(i.meta.shape, dtype=precision.dtype(i.meta.dtype)) for i in users]
            if last and program._count is not None:
                module.count = program._count(*whole)
            if first:
                small = [torch.empty((b.shape[0],) + tuple(b.shape[1:]), dtype=precision.dtype(b.dtype))
                         for b in sg.inputs]
                feeds = [small] * micro
            with watching(axes, opt, tracked=values + stepped(inner, masters)) as watch:
                watch.set_phase("communication")  # the schedule's receive buffers, one per micro-batch
                if not first:
                    feeds = [[_buffer(b, mesh_shape, precision) for b in sg.inputs] for _ in range(micro)]
                grads = [[_buffer(b, mesh_shape, precision) for b in sg.outputs] for _ in range(micro)]
                watch.memory.phase = watch.log.phase = "forward"
                reset_pending()
                held = {}
                with deferred_gradient_sums():
                    for what, i in order(micro, stage.in_flight):
                        watch.memory.phase = watch.log.phase = "forward" if what == "F" else "backward"
                        if what == "F":
                            held[i] = module(*feeds[i])
                            for _, v, t in blocks["forward"]:
                                watch.log.issued.append(("send_recv", PP_AXIS,
                                                         math.prod(t.shape) * held[i][v].element_size(), "forward"))
                            watch.memory.end_forward()
                            continue
                        out = held.pop(i)
                        if last:
                            out.backward()
                        else:
                            sends = [(o, g) for o, g in zip(out, grads[i]) if o.requires_grad]
                            torch.autograd.backward([o for o, _ in sends], [g for _, g in sends])
                        for _, v, t in blocks["backward"]:
                            watch.log.issued.append(("send_recv", PP_AXIS,
                                                     math.prod(t.shape) * feeds[i][v].element_size(), "backward"))
                watch.set_phase("optimizer")
                if masters is not None:
                    masters.take_gradients(inner.stored)
                opt.step()
                if stage.zero == 1:  # the updated shards gathered: the step's last collectives
                    masters.refresh(inner.stored, changed_only=False)
            return measured(watch, module, opt, rank=rank, stage=sg.index, seconds=time.perf_counter() - start,
                            masters=masters)


def _buffer(b, mesh_shape, precision: Precision) -> torch.Tensor:
    t = torch.empty(b.local_shape(mesh_shape), dtype=precision.dtype(b.dtype))
    return t.requires_grad_(b.requires_grad)


__all__ = ["measure_stage_rank"]
