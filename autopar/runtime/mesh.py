"""Process groups per mesh axis, from torch's DeviceMesh (gloo on CPU, NCCL on GPU).

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


_MESHES: dict = {}  # (default group, mesh shape, device type) -> RankMesh


def rank_mesh(mesh_shape, *, device_type: str = "cpu") -> RankMesh:
    """This rank's :class:`RankMesh`; call on every rank (creating groups is collective). The
    groups of a mesh shape are made once per process group and shared by every program."""
    from torch.distributed.device_mesh import init_device_mesh

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
    key = (id(dist.group.WORLD), mesh_shape, device_type)
    if key in _MESHES:
        return _MESHES[key]
    names = tuple(f"axis{a}" for a in range(len(mesh_shape)))
    device_mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=names)
    coord = tuple(int(c) for c in device_mesh.get_coordinate())
    if coord != coord_of(dist.get_rank(), mesh_shape):
        raise AutoparError(f"DeviceMesh put rank {dist.get_rank()} at {coord}, expected row-major")
    groups = tuple(device_mesh.get_group(a) if n > 1 else None for a, n in enumerate(mesh_shape))
    _MESHES[key] = RankMesh(mesh_shape, coord, groups)
    return _MESHES[key]


def default_device() -> torch.device:
    """``cuda:<local rank>`` under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["axis_lines", "coord_of", "default_device", "rank_mesh"]
