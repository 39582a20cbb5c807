"""ShardingAssignment: what the planner decides and code generation consumes.

One :class:`~autopar.passes.rules.registry.Strategy` per compute node (FX node name), one
*storage* sharding per placeholder and one sharding per graph output::

    ShardingAssignment(
        mesh_shape=(2,),
        node_strategies={"linear": Strategy(...), ...},
        placeholder_shardings={"x": (Shard(0),), "p_fc1_weight": (Replicate(),)},
        output_shardings=((Replicate(),),),
    )

A parameter stored ``S(0)`` where its consumer needs ``R`` is ZeRO-3/FSDP: it is all-gathered on
use and its gradient reduce-scattered. Ops without a sharding rule may be left out of
``node_strategies`` (they run all-replicated); ``getitem`` nodes follow their tuple element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from autopar.core.errors import ShardingError
from autopar.core.ir import Strategy
from autopar.core.placement import Partial, Placement, Replicate, Shard, format_sharding


def _check_sharding(sharding, ndim: int, what: str) -> tuple:
    if not isinstance(sharding, tuple) or len(sharding) != ndim:
        raise ShardingError(
            f"{what}: sharding {sharding!r} must be a tuple of {ndim} placements (one per mesh axis)"
        )
    for p in sharding:
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise ShardingError(f"{what}: {p!r} is not a placement (Shard(d), Replicate(), Partial())")
    return sharding


@dataclass(frozen=True)
class ShardingAssignment:
    """A full sharding decision for one captured graph on a mesh (see the module docstring)."""

    mesh_shape: tuple[int, ...]
    node_strategies: Mapping[str, Strategy]
    placeholder_shardings: Mapping[str, tuple[Placement, ...]]
    output_shardings: tuple[tuple[Placement, ...], ...]

    def __post_init__(self):
        mesh = tuple(self.mesh_shape)
        if not mesh or not all(isinstance(n, int) and n >= 1 for n in mesh):
            raise ShardingError(f"mesh_shape must be a non-empty tuple of positive ints, got {self.mesh_shape!r}")
        object.__setattr__(self, "mesh_shape", mesh)
        k = len(mesh)
        strategies = dict(self.node_strategies)
        for name, strat in strategies.items():
            if not isinstance(strat, Strategy):
                raise ShardingError(f"node {name}: {strat!r} is not a Strategy")
            for s in strat.inputs + strat.outputs:
                _check_sharding(s, k, f"node {name}")
        holders = dict(self.placeholder_shardings)
        for name, s in holders.items():
            _check_sharding(s, k, f"placeholder {name}")
            if any(isinstance(p, Partial) for p in s):
                raise ShardingError(
                    f"placeholder {name} is stored {format_sharding(s)}: stored tensors cannot be"
                    " pending sums; store it R or S(d)"
                )
        outs = tuple(tuple(s) for s in self.output_shardings)
        for i, s in enumerate(outs):
            _check_sharding(s, k, f"output {i}")
        object.__setattr__(self, "node_strategies", strategies)
        object.__setattr__(self, "placeholder_shardings", holders)
        object.__setattr__(self, "output_shardings", outs)

    @property
    def world_size(self) -> int:
        n = 1
        for k in self.mesh_shape:
            n *= k
        return n

    def summary(self) -> str:
        """One line per placeholder and node: its sharding or strategy."""
        lines = [f"mesh {self.mesh_shape}"]
        lines += [f"  {n}: {format_sharding(s)}" for n, s in self.placeholder_shardings.items()]
        lines += [f"  {n}: {s.name}" for n, s in self.node_strategies.items()]
        lines += [f"  output {i}: {format_sharding(s)}" for i, s in enumerate(self.output_shardings)]
        return "\n".join(lines)


__all__ = ["ShardingAssignment"]
