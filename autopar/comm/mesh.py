"""This rank's view of a mesh: its coordinate and a process group per mesh axis (gloo on CPU,
NCCL on GPU), with ranks laid out as :mod:`autopar.core.layout` says."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from autopar.comm.groups import group_names, resolve
from autopar.core.errors import AutoparError
from autopar.core.layout import axis_lines, coord_of


class AxisGroup(NamedTuple):
    """One mesh axis as a collective sees it: its size, this rank's coordinate on it, and its
    process group (None for an axis of size 1)."""

    size: int
    coord: int
    group: object


@dataclass(frozen=True)
class RankMesh:
    """This rank's view of the mesh: its coordinate and the name of its process group on each
    mesh axis (None for an axis of size 1; names, not groups: :mod:`autopar.comm.groups`)."""

    mesh_shape: tuple[int, ...]
    coord: tuple[int, ...]
    group_names: tuple

    def __post_init__(self):
        if not (len(self.mesh_shape) == len(self.coord) == len(self.group_names)):
            raise AutoparError("RankMesh needs one coordinate and one group per mesh axis")
        if any(not 0 <= c < n for c, n in zip(self.coord, self.mesh_shape)):
            raise AutoparError(f"coordinate {self.coord} is outside the mesh {self.mesh_shape}")

    def group(self, axis: int):
        """The process group of mesh axis ``axis`` (None for an axis of size 1)."""
        return resolve(self.group_names[axis])

    def axis(self, axis: int) -> AxisGroup:
        """Mesh axis ``axis`` as a collective sees it (the group resolved now: autograd keeps it
        for a backward that may run after the program has returned)."""
        return AxisGroup(self.mesh_shape[axis], self.coord[axis], self.group(axis))


def rank_mesh(mesh_shape) -> RankMesh:
    """This rank's :class:`RankMesh`; call on every rank (creating groups is collective). The
    groups of a mesh shape are made once per default process group and shared by every program."""
    if not dist.is_initialized():
        raise AutoparError(
            "torch.distributed is not initialised: run under torchrun (or"
            " autopar.testing.run_distributed) and call torch.distributed.init_process_group first"
        )
    mesh_shape = tuple(mesh_shape)
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise AutoparError(
            f"the plan's mesh {mesh_shape} needs {math.prod(mesh_shape)} ranks but the job has"
            f" {world}; launch it with that many processes"
        )
    me = dist.get_rank()
    names = []
    for axis, n in enumerate(mesh_shape):
        lines = axis_lines(mesh_shape, axis) if n > 1 else []
        names.append(next((name for line, name in zip(lines, group_names(lines)) if me in line), None))
    return RankMesh(mesh_shape, coord_of(me, mesh_shape), tuple(names))


def default_device() -> torch.device:
    """``cuda:<local rank>`` under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = [
    "AxisGroup",
    "RankMesh",
    "default_device",
    "rank_mesh",
]
