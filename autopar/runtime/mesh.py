"""Process groups per mesh axis (gloo on CPU, NCCL on GPU).

Ranks are numbered row-major over the mesh: on a ``(2, 2)`` mesh rank 1 is coordinate
``(0, 1)``, and the group of axis 1 holds ranks that differ only in the last coordinate.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.collectives import RankMesh
from autopar.runtime.groups import group_names


def coord_of(rank: int, mesh_shape) -> tuple[int, ...]:
    """Row-major coordinate of ``rank`` on ``mesh_shape``."""
    coord = []
    for n in reversed(tuple(mesh_shape)):
        coord.append(rank % n)
        rank //= n
    return tuple(reversed(coord))


def axis_lines(mesh_shape, axis: int, ranks=None) -> list[list[int]]:
    """The rank groups along mesh axis ``axis``: ranks differing only in that coordinate.
    ``ranks`` (row-major over ``mesh_shape``; default ``0..N-1``) names a sub-mesh's ranks."""
    mesh_shape = tuple(mesh_shape)
    grid = np.asarray(range(math.prod(mesh_shape)) if ranks is None else ranks).reshape(mesh_shape)
    return [list(map(int, line)) for line in np.moveaxis(grid, axis, -1).reshape(-1, mesh_shape[axis])]


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


__all__ = ["axis_lines", "coord_of", "default_device", "rank_mesh"]
