"""The collectives each rank of a pipelined plan's stage issues per step, from the split and the
analysis code generation runs (:func:`~autopar.plan.split.split_stages`,
:func:`~autopar.plan.split.analysed_stage`), counted as :func:`~autopar.plan.records.graph_collectives`
counts a one-program plan's. ``small`` is the model captured at the micro-batch size, the graph
the pipeline runtime splits, so bytes are a micro-batch's.

Per step, a stage's rank issues:

- every collective of its program once per micro-batch (forward, backward and, on a stage that
  recomputes, the forward's again);
- the gradient sums of its trainable parameters once, on the gradient summed over the
  micro-batches; on a ZeRO-1 stage as reduce-scatters into its shards followed by all-gathers
  after the optimizer step (:mod:`autopar.runtime.zero`), except for a parameter several stages
  hold, which keeps whole optimizer state;
- per micro-batch, a ``send_recv`` (mesh axis ``-1``: between stages) of each block it puts on
  the wire (:func:`autopar.core.crossmesh.sent_blocks`): forward the blocks of its boundary
  outputs, backward those of the gradients of the values it received that carry one. Between
  equal meshes that is its piece of each value; between stages on different meshes a rank may
  send its piece in several blocks, to several receivers, or nothing (another replica sends),
  so the records are those of the stage's first rank, the one ``verify`` runs.

Not recorded, and not measured by ``verify`` either: the sum over stages of a parameter several
stages hold (GPT-2's tied embedding and head, after the schedule) and the broadcast of the loss to
every rank: each moves one tensor once per step outside the stage's program.
"""

from __future__ import annotations

import dataclasses
import math

from autopar.core.crossmesh import links, sent_blocks
from autopar.cost_models.communication import flat_time
from autopar.plan.data import CollectiveRecord, Plan
from autopar.plan.records import graph_collectives, held, trainable_parameters
from autopar.plan.split import analysed_stage, loss_split, split_stages

PP_AXIS = -1  # the mesh axis a send between stages is recorded on


def stage_collectives(small, plan: Plan, *, precision) -> list[list[tuple[str, str, int, float, str]]]:
    """Per stage of ``plan``, ``(phase, kind, mesh axis, bytes per rank, node)`` of every
    collective its first rank issues per step (module docstring), in ``precision``."""
    trained = trainable_parameters(small)
    trainable = {i.name for i in small.inputs if i.node in trained}
    graphs = split_stages(small, plan, loss=loss_split(small, micro_batches=plan.micro_batches), trainable=trainable)
    holders: dict = {}
    for sg in graphs:
        for s in sg.stored:
            if s.trainable:
                holders[s.fqn] = holders.get(s.fqn, 0) + 1
    itemsize = held(small, precision)
    blocks = links(plan.stages, graphs)
    out = []
    for stage, sg in zip(plan.stages, graphs):
        zero = 2 if stage.zero == 1 else 0  # a stage's ZeRO-1 reduce-scatters its summed gradients
        zero_of = {s.node: zero if holders[s.fqn] == 1 else 0 for s in sg.stored if s.trainable}
        gm = analysed_stage(sg)
        frozen = {s.node for s in sg.stored if s.kind == "parameter" and not s.trainable}
        sums, calls = graph_collectives(gm, tuple(sg.mesh_shape), itemsize, zero_of, frozen=frozen,
                                        recompute=stage.recompute)
        nodes = {n.name: n for n in gm.graph.nodes}
        values = {"forward": sg.outputs, "backward": sg.inputs}
        calls += [(phase, "send_recv", PP_AXIS, math.prod(t.shape) * itemsize(nodes[values[phase][i].name]),
                   values[phase][i].name) for phase, i, t in sent_blocks(blocks, sg.index, stage.ranks[0])]
        out.append(sums + calls * plan.micro_batches)
    return out


def with_stage_records(plan: Plan, small, *, precision) -> Plan:
    """``plan`` with each stage's ``collective_records`` (:func:`stage_collectives`), timed on the
    stage's mesh as the pipeline planner times them (a send on the link between stages)."""
    link = plan.cluster.stage_link()
    stages = []
    for stage, records in zip(plan.stages, stage_collectives(small, plan, precision=precision)):
        cluster = dataclasses.replace(plan.cluster, mesh_shape=tuple(stage.mesh_shape))
        seconds: dict = {}
        for phase, kind, axis, nbytes, node in records:
            if (kind, axis, nbytes) not in seconds:
                seconds[(kind, axis, nbytes)] = (flat_time(kind, nbytes, 2, link) if axis == PP_AXIS
                                                 else cluster.collective_time(kind, nbytes, axis))
        stages.append(dataclasses.replace(stage, collective_records=tuple(
            CollectiveRecord(kind, (axis,), nbytes, phase, node, seconds[(kind, axis, nbytes)])
            for phase, kind, axis, nbytes, node in records)))
    return dataclasses.replace(plan, stages=tuple(stages))


__all__ = ["PP_AXIS", "stage_collectives", "with_stage_records"]
