"""Resharding: the collectives that turn a producer's sharding into the one a consumer needs.

:func:`plan_steps` lists them as :class:`Step` s, one mesh axis each, in an order that is correct
for dims sharded on several axes (which are split axis-0-major):

1. pending sums that must go: ``P -> R`` all-reduce (on the local shard, before any gather);
2. gathers, innermost mesh axis first: ``S(d) -> R`` for every shard that does not survive
   (a shard survives when the target shards the same dim on the same axis *and* on the same
   earlier axes);
3. splits, outermost axis first: ``R -> S(d)`` local chunk, ``P -> S(d)`` reduce-scatter,
   ``R -> P`` keep on coordinate 0 (zeros elsewhere).

A gather immediately followed by a split on the same axis becomes one all-to-all.
:func:`reshard_bytes` prices a plan by the bytes one rank sends (for greedy choices, not for
planning)::

    >>> [str(s) for s in plan_steps((P_, Shard(0)), (R_, R_), ndim=2)]
    ['all_reduce(axis=0)', 'all_gather(axis=1, dim=0)']
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.errors import ShardingError
from autopar.core.placement import Partial, Replicate, Shard, Sharding

P_, R_ = Partial(), Replicate()

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "chunk", "all_to_all", "to_partial")


@dataclass(frozen=True)
class Step:
    """One collective (or local cut) on mesh axis ``axis``.

    ``dim`` is the tensor dim gathered/split; an all-to-all gathers ``dim`` and splits ``dim2``.
    """

    kind: str
    axis: int
    dim: int | None = None
    dim2: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ShardingError(f"unknown resharding step {self.kind!r}; one of {KINDS}")
        needs_dim = self.kind in ("reduce_scatter", "all_gather", "chunk", "all_to_all")
        if needs_dim != (self.dim is not None) or (self.kind == "all_to_all") != (self.dim2 is not None):
            raise ShardingError(f"resharding step {self.kind} has the wrong dims ({self.dim}, {self.dim2})")

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all(axis={self.axis}, dim={self.dim}, dim2={self.dim2})"
        dim = "" if self.dim is None else f", dim={self.dim}"
        return f"{self.kind}(axis={self.axis}{dim})"


def _same_prefix(state: list, dst: Sharding, axis: int, dim: int) -> bool:
    """Whether ``state`` and ``dst`` shard ``dim`` on the same axes before ``axis``."""
    return all((state[b] == Shard(dim)) == (dst[b] == Shard(dim)) for b in range(axis))


def plan_steps(src: Sharding, dst: Sharding, *, ndim: int) -> list[Step]:
    """The steps from ``src`` to ``dst`` (both one placement per mesh axis); ``[]`` if equal."""
    if len(src) != len(dst):
        raise ShardingError(f"shardings {src} and {dst} are for meshes of different rank")
    for sh in (src, dst):
        for p in sh:
            if isinstance(p, Shard) and p.dim >= ndim:
                raise ShardingError(f"sharding {sh} shards dim {p.dim} of a {ndim}-dim tensor")
    state = list(src)
    steps: list[Step] = []
    n = len(src)
    # 1. reduce pending sums whose target is R (P -> S is a reduce-scatter in phase 3)
    for a in range(n):
        if isinstance(state[a], Partial) and isinstance(dst[a], Replicate):
            steps.append(Step("all_reduce", a))
            state[a] = R_
    # 2. gather the shards that do not survive, innermost axis first
    for a in reversed(range(n)):
        p = state[a]
        if isinstance(p, Shard) and not (dst[a] == p and _same_prefix(state, dst, a, p.dim)):
            steps.append(Step("all_gather", a, p.dim))
            state[a] = R_
    # a shard that survived above a gathered axis is still valid: only later axes were gathered
    # 3. splits, outermost axis first
    for a in range(n):
        want = dst[a]
        if state[a] == want:
            continue
        if isinstance(want, Shard):
            kind = "reduce_scatter" if isinstance(state[a], Partial) else "chunk"
            steps.append(Step(kind, a, want.dim))
        elif isinstance(want, Partial):
            steps.append(Step("to_partial", a))
        else:  # pragma: no cover - phases 1 and 2 leave no other case
            raise ShardingError(f"cannot reshard {src} to {dst} on axis {a}")
        state[a] = want
    return _fuse_all_to_all(steps)


def _fuse_all_to_all(steps: list[Step]) -> list[Step]:
    out: list[Step] = []
    for step in steps:
        prev = out[-1] if out else None
        if (prev is not None and prev.kind == "all_gather" and step.kind == "chunk"
                and prev.axis == step.axis and prev.dim != step.dim):
            out[-1] = Step("all_to_all", step.axis, prev.dim, step.dim)
        else:
            out.append(step)
    return out


def local_numel(shape, sharding: Sharding, mesh_shape) -> int:
    """Elements of one rank's piece (``Partial`` and ``Replicate`` keep the whole dim)."""
    n = math.prod(shape)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            n //= mesh_shape[axis]
    return n


def reshard_bytes(src: Sharding, dst: Sharding, *, shape, itemsize: int, mesh_shape) -> float:
    """Bytes one rank sends to go from ``src`` to ``dst`` (ring collectives; local cuts are free)."""
    state = list(src)
    total = 0.0
    for step in plan_steps(src, dst, ndim=len(shape)):
        k = mesh_shape[step.axis]
        size = local_numel(shape, tuple(state), mesh_shape) * itemsize
        if step.kind == "all_reduce":
            total += 2 * (k - 1) / k * size
            state[step.axis] = R_
        elif step.kind == "all_gather":
            total += (k - 1) * size
            state[step.axis] = R_
        elif step.kind == "reduce_scatter":
            total += (k - 1) / k * size
            state[step.axis] = Shard(step.dim)
        elif step.kind == "all_to_all":
            total += (k - 1) / k * size
            state[step.axis] = Shard(step.dim2)
        elif step.kind == "chunk":
            state[step.axis] = Shard(step.dim)
        else:
            state[step.axis] = P_
    return total


__all__ = ["KINDS", "Step", "local_numel", "plan_steps", "reshard_bytes"]
