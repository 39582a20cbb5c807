"""Placements of a tensor on one mesh axis, and shardings (one placement per mesh axis).

The vocabulary is DTensor's: ``Shard(dim)``, ``Replicate()``, ``Partial("sum")``. They print
and parse in the short form plans use::

    >>> format_sharding((Shard(0), Replicate()))
    'S(0),R'
    >>> parse_sharding("S(0),P(sum)")
    (Shard(dim=0), Partial(op='sum'))
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.core.errors import ShardingError

REDUCE_OPS = ("sum",)


@dataclass(frozen=True)
class Shard:
    """The tensor is split evenly along tensor dim ``dim`` over the mesh axis."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ShardingError(f"Shard dim must be a non-negative int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank on the mesh axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the tensor is their reduction (a pending collective)."""

    op: str = "sum"

    def __post_init__(self):
        if self.op not in REDUCE_OPS:
            raise ShardingError(f"Partial reduce op must be one of {REDUCE_OPS}, got {self.op!r}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Shard | Replicate | Partial
Sharding = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()

_PLACEMENT_RE = re.compile(r"^(?:S\((\d+)\)|R|P\((\w+)\))$")


def parse_placement(text: str) -> Placement:
    """Parse ``"S(1)"``, ``"R"`` or ``"P(sum)"``."""
    m = _PLACEMENT_RE.match(text.strip())
    if not m:
        raise ShardingError(f"cannot parse placement {text!r}: write S(<dim>), R or P(sum)")
    if m.group(1) is not None:
        return Shard(int(m.group(1)))
    if m.group(2) is not None:
        return Partial(m.group(2))
    return Replicate()


def format_sharding(sharding: Sharding) -> str:
    """``(Shard(0), Replicate())`` -> ``"S(0),R"``."""
    return ",".join(str(p) for p in sharding)


def parse_sharding(text: str) -> Sharding:
    """Inverse of :func:`format_sharding`."""
    return tuple(parse_placement(part) for part in text.split(","))


def replicated(mesh_ndim: int) -> Sharding:
    """The all-replicated sharding on a mesh of ``mesh_ndim`` axes."""
    return (R,) * mesh_ndim


def local_shape(shape, sharding: Sharding, mesh_shape) -> tuple[int, ...]:
    """Shape of one rank's piece; raises ShardingError when a sharded dim does not divide evenly."""
    out = list(shape)
    for axis, placement in enumerate(sharding):
        if isinstance(placement, Shard):
            if placement.dim >= len(out):
                raise ShardingError(
                    f"S({placement.dim}) on mesh axis {axis} but the tensor has {len(out)} dims"
                )
            n = mesh_shape[axis]
            if out[placement.dim] % n:
                raise ShardingError(
                    f"dim {placement.dim} of size {out[placement.dim]} does not split evenly over"
                    f" mesh axis {axis} of size {n}"
                )
            out[placement.dim] //= n
    return tuple(out)


def fits(shape, sharding: Sharding, mesh_shape) -> bool:
    """Whether ``sharding`` splits a tensor of ``shape`` evenly on ``mesh_shape``."""
    try:
        local_shape(shape, sharding, mesh_shape)
    except ShardingError:
        return False
    return True
