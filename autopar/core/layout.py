"""Where each rank sits on a mesh and which piece of a tensor it holds.

Ranks are numbered row-major over the mesh: on a ``(2, 2)`` mesh rank 1 is coordinate ``(0, 1)``,
and the ranks along axis 1 differ only in the last coordinate. A dim sharded on several mesh axes
is split axis-0-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from autopar.core.errors import ShardingError
from autopar.core.ir import Strategy
from autopar.core.placement import Shard, Sharding, local_shape


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


@dataclass(frozen=True)
class Piece:
    """The part of a global tensor one rank holds: dim ``d`` covers ``[starts[d], stops[d])``."""

    global_shape: tuple[int, ...]
    starts: tuple[int, ...]
    stops: tuple[int, ...]

    def __post_init__(self):
        n = len(self.global_shape)
        if len(self.starts) != n or len(self.stops) != n:
            raise ShardingError(f"a Piece needs one start and stop per dim of {self.global_shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The local shape."""
        return tuple(b - a for a, b in zip(self.starts, self.stops))


@dataclass(frozen=True)
class LocalContext:
    """What a local implementation knows about its rank: one :class:`Piece` per tensor input
    and output (pytree order). ``Partial`` and ``Replicate`` pieces cover whole dims."""

    inputs: tuple[Piece, ...]
    outputs: tuple[Piece, ...]


def piece_of(shape, sharding: Sharding, mesh_shape, coord) -> Piece:
    """The :class:`Piece` that rank ``coord`` holds of a tensor of ``shape`` under ``sharding``.

    A dim sharded on several mesh axes is split axis-0-major, (as ``passes.rules.simulate.distribute`` does).
    """
    local = local_shape(shape, sharding, mesh_shape)
    starts = []
    for d in range(len(shape)):
        index = 0
        for axis, placement in enumerate(sharding):
            if placement == Shard(d):
                index = index * mesh_shape[axis] + coord[axis]
        starts.append(index * local[d])
    return Piece(tuple(shape), tuple(starts), tuple(a + n for a, n in zip(starts, local)))


def local_context(*, input_shapes, output_shapes, strategy: Strategy, mesh_shape, coord) -> LocalContext:
    """The :class:`LocalContext` of rank ``coord`` (one index per mesh axis) under ``strategy``."""
    ins = tuple(piece_of(s, sh, mesh_shape, coord) for s, sh in zip(input_shapes, strategy.inputs))
    outs = tuple(piece_of(s, sh, mesh_shape, coord) for s, sh in zip(output_shapes, strategy.outputs))
    return LocalContext(ins, outs)


def piece_cuts(shape, sharding, mesh_shape, coord) -> tuple:
    """``(dim, start, length)`` narrowings that cut rank ``coord``'s piece of a ``shape`` tensor."""
    piece = piece_of(tuple(shape), sharding, mesh_shape, coord)
    return tuple((d, a, b - a) for d, (a, b) in enumerate(zip(piece.starts, piece.stops)) if (a, b) != (0, shape[d]))


def local_piece(full: torch.Tensor, sharding, mesh_shape, coord) -> torch.Tensor:
    """Rank ``coord``'s piece of ``full`` (a view)."""
    for d, start, length in piece_cuts(full.shape, sharding, mesh_shape, coord):
        full = full.narrow(d, start, length)
    return full


__all__ = ["LocalContext", "Piece", "axis_lines", "coord_of", "local_context", "local_piece", "piece_cuts",
           "piece_of"]
