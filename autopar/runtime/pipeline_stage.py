"""What one rank of a pipeline runs (:mod:`autopar.runtime.pipeline`): its stage's module, the
process groups the pipeline uses, and the dtype boundary pieces travel in."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.comm.groups import group_names
from autopar.comm.mesh import RankMesh
from autopar.core.errors import PipelineError
from autopar.core.layout import axis_lines, local_piece
from autopar.core.placement import Shard
from autopar.runtime.program import DistributedModule


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """gloo sends no booleans: they travel as bytes."""
    return torch.uint8 if dtype == torch.bool else dtype


class StageModule(nn.Module):
    """What one rank of a stage runs: received pieces (stage 0: the micro-batch) in, this rank's
    program, boundary pieces (last stage: its share of the loss) out."""

    def __init__(self, module: DistributedModule, stage, mesh: RankMesh, *, first: bool, scale: float):
        super().__init__()
        self.module = module
        self._stage = stage
        self._mesh = mesh
        self._first = first
        self._scale = scale
        self.count = None  # the whole batch's count, fed before each step (LossSplit "count")

    def forward(self, *received):
        values = []
        for b, sharding, x in zip(self._stage.inputs, self._stage.input_shardings, received):
            if self._first and any(isinstance(p, Shard) for p in sharding):
                x = local_piece(x, sharding, self._mesh.mesh_shape, self._mesh.coord).contiguous()
            if x.dtype != b.dtype:
                x = x.to(b.dtype)
            elif x.requires_grad:
                x = x.view_as(x)  # not a leaf: a gradient all-reduce on it returns its sum
            values.append(x)
        values += [self.module.stored(s.fqn) for s in self._stage.stored]
        if self._stage.count is not None:
            values.append(self.count)
        out = self.module(*values)
        if not self._stage.outputs:
            return out[0] * self._scale if self._scale != 1 else out[0]
        return tuple(o.to(wire_dtype(o.dtype)).contiguous() for o in out)


def stage_groups(stages, shared_holders):
    """The names of the process groups the pipeline uses (collective): per stage its axes', and
    per set of stages holding a shared parameter this rank's group of theirs: the ranks at the same
    position of each where the stages are equally wide, else every rank of them all."""
    me = dist.get_rank()
    axes = []
    for st in stages:
        mine = []
        for axis, n in enumerate(st.mesh_shape):
            lines = axis_lines(st.mesh_shape, axis, st.ranks) if n > 1 else []
            for line in lines:
                if line != sorted(line):
                    raise PipelineError(f"stage {st.index}'s ranks {st.ranks} are not increasing along mesh"
                                        f" axis {axis}: re-plan (stages take consecutive ranks)")
            mine.append(next((name for line, name in zip(lines, group_names(lines)) if me in line), None))
        axes.append(tuple(mine))
    shared = {}
    for holders in shared_holders:
        widths = {len(stages[k].ranks) for k in holders}
        if len(widths) == 1:
            lines = [[stages[k].ranks[c] for k in holders] for c in range(widths.pop())]
        else:
            lines = [sorted(r for k in holders for r in stages[k].ranks)]
        for line, name in zip(lines, group_names(lines)):
            if me in line:
                shared[holders] = name
    return tuple(axes), shared


__all__ = ["StageModule", "stage_groups", "wire_dtype"]
