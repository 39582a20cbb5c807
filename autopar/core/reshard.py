"""Resharding: the one planner of the collectives that turn a producer's sharding into the one a
consumer needs, of their backward, and of their price. Code generation emits these steps and
the cost model prices them, so a plan costs what its program runs.

**Forward.** :func:`plan_steps` lists :class:`Step` s, one mesh axis each, in an order that is
correct for dims sharded on several axes (which are split axis-0-major):

1. pending sums that must go: ``P -> R`` all-reduce (on the local shard, before any gather);
2. gathers, innermost mesh axis first: ``S(d) -> R`` for every shard that does not survive
   (a shard survives when the target shards the same dim on the same axis *and* on the same
   earlier axes);
3. splits, outermost axis first: ``R -> S(d)`` local chunk, ``P -> S(d)`` reduce-scatter,
   ``R -> P`` keep on coordinate 0 (zeros elsewhere).

A gather immediately followed by a split on the same axis becomes one all-to-all::

    >>> [str(s) for s in plan_steps((P_, Shard(0)), (R_, R_), ndim=2)]
    ['all_reduce(axis=0)', 'all_gather(axis=1, dim=0)']

**Backward.** Each rank differentiates its own program; a step's adjoint depends on the *kind*
of gradient arriving on its mesh axis: ``"R"`` the whole gradient, ``"P"`` a pending sum (its
sum over the axis is the gradient), ``"S"`` this rank's block (:data:`ADJOINTS`)::

    step            arriving   adjoint                              hands back
    all_reduce      R | P      identity (Megatron's g) | all_reduce R
    all_gather      R | P      slice | reduce_scatter (ZeRO-3)      S
    reduce_scatter  S          all_gather                           R
    all_to_all      S          all_to_all                           S
    chunk           S          all_gather | zero_pad                R | P, as the source picks
    to_partial      R          identity | mask                      R | P, as the source picks

A consumer hands back ``S`` on a sharded input, ``R`` on a pending-sum input and, on a
replicated input, what :func:`input_kind` says: ``P`` when its work is split on the axis
(Megatron's *f* must sum it somewhere). :func:`walk_back` carries a gradient along an edge;
:func:`lone_backward` settles an edge whose source has no other consumer (the cost model's view;
code generation settles the whole graph).

**Price.** :func:`edge_collectives` lists an edge's collectives as ``(phase, kind, axis,
pieces)``: the collective moves the tensor's bytes / ``pieces`` per rank, in nccl-tests' size
convention (the larger buffer, see :mod:`autopar.core.collective_kinds`); :func:`price` gives
:class:`~autopar.core.collective_kinds.Collective` s for one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.collective_kinds import COLLECTIVE_KINDS, Collective
from autopar.core.errors import ShardingError
from autopar.core.placement import Partial, Placement, Replicate, Shard, Sharding

P_, R_ = Partial(), Replicate()

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "chunk", "all_to_all", "to_partial")

# step kind -> {gradient kind arriving after it: (its adjoint, the kind it hands back)}; "F":
# the step can hand back R or P, and the source picks with FLEXIBLE
ADJOINTS = {
    "all_reduce": {"R": ("identity", "R"), "P": ("all_reduce", "R")},
    "all_gather": {"R": ("slice", "S"), "P": ("reduce_scatter", "S")},
    "reduce_scatter": {"S": ("all_gather", "R")},
    "all_to_all": {"S": ("all_to_all", "S")},
    "chunk": {"S": (None, "F")},
    "to_partial": {"R": (None, "F")},
}
FLEXIBLE = {"chunk": {"R": "all_gather", "P": "zero_pad"}, "to_partial": {"R": "identity", "P": "mask"}}
# the adjoint of a step that has a choice, where no gradient flows through it
DEFAULT_BACKWARD = {"all_reduce": "identity", "all_gather": "slice", "chunk": "all_gather", "to_partial": "identity"}


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

    @property
    def placement(self) -> Placement:
        """The placement the step leaves on its mesh axis."""
        if self.kind in ("all_reduce", "all_gather"):
            return R_
        if self.kind == "to_partial":
            return P_
        return Shard(self.dim2 if self.kind == "all_to_all" else self.dim)

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all(axis={self.axis}, dim={self.dim}, dim2={self.dim2})"
        dim = "" if self.dim is None else f", dim={self.dim}"
        return f"{self.kind}(axis={self.axis}{dim})"


def _same_prefix(state: list, dst: Sharding, axis: int, dim: int) -> bool:
    """Whether ``state`` and ``dst`` shard ``dim`` on the same axes before ``axis``."""
    return all((state[b] == Shard(dim)) == (dst[b] == Shard(dim)) for b in range(axis))


def plan_steps(src: Sharding, dst: Sharding, *, ndim: int, mesh_shape=None) -> list[Step]:
    """The steps from ``src`` to ``dst`` (both one placement per mesh axis); ``[]`` if equal.
    With ``mesh_shape``, a placement on a mesh axis of size 1 is what it means there (the whole,
    complete tensor: ``R``), so no step is planned on such an axis and none stands between two
    steps that fuse into an all-to-all."""
    if len(src) != len(dst) or (mesh_shape is not None and len(mesh_shape) != len(src)):
        raise ShardingError(f"shardings {src} and {dst} are for meshes of different rank")
    if mesh_shape is not None:
        src = tuple(p if n > 1 else R_ for p, n in zip(src, mesh_shape))
        dst = tuple(p if n > 1 else R_ for p, n in zip(dst, mesh_shape))
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


# ----------------------------------------------------------------------------- backward


def input_kind(placement: Placement, replicated_kind: str | None) -> str | None:
    """The kind of gradient a consumer hands back on one mesh axis to an input of ``placement``
    there, when its replicated inputs get ``replicated_kind``: ``"P"`` if the consumer's work is
    split on the axis (some output is not ``R``), else that of its outputs' gradients."""
    if isinstance(placement, Shard):
        return "S"
    if isinstance(placement, Partial):
        return "R"
    return replicated_kind


def walk_back(steps: list[Step], axis: int, kind: str) -> tuple[dict[int, str], str, int | None]:
    """Carry a gradient of ``kind`` arriving after ``steps`` back to their start on mesh ``axis``.

    Returns the adjoint of each step on the axis (by index; a flexible step the start picks for
    is left out), the kind of gradient the start receives, and, when that kind is ``"F"``, the
    index of the flexible step: the start picks its adjoint, ``FLEXIBLE[step.kind]["R" or "P"]``."""
    adjoints: dict[int, str] = {}
    flexible = None
    for i in reversed(range(len(steps))):
        step = steps[i]
        if step.axis != axis:
            continue
        if kind == "F":  # an earlier step needs a definite kind: the flexible one hands back R
            adjoints[flexible] = FLEXIBLE[steps[flexible].kind]["R"]
            kind = "R"
        choice = ADJOINTS[step.kind].get(kind)
        if choice is None:
            raise ShardingError(f"{step} cannot take a gradient of kind {kind!r} back on mesh axis {axis}")
        adjoint, kind = choice
        if adjoint is None:
            flexible = i
        else:
            adjoints[i] = adjoint
    return adjoints, kind, flexible if kind == "F" else None


def lone_backward(steps: list[Step], kinds) -> tuple[list[str | None], tuple[int, ...]]:
    """The adjoint of each step, and the mesh axes whose gradient reaches the source as a pending
    sum (all-reduced there: Megatron's *f*, a data-parallel gradient), for a consumer handing
    back ``kinds`` (one per mesh axis) to a source that has no other consumer. A flexible step
    then hands back the whole gradient, as code generation resolves such a source."""
    backward = [DEFAULT_BACKWARD.get(s.kind) for s in steps]
    pending = []
    for axis, kind in enumerate(kinds):
        adjoints, kind, flexible = walk_back(steps, axis, kind)
        for i, adjoint in adjoints.items():
            backward[i] = adjoint
        if flexible is not None:
            backward[flexible] = FLEXIBLE[steps[flexible].kind]["R"]
        elif kind == "P":
            pending.append(axis)
    return backward, tuple(pending)


# ----------------------------------------------------------------------------- price


def _pieces(state, mesh_shape) -> int:
    return math.prod(n for n, p in zip(mesh_shape, state) if isinstance(p, Shard))


def regathered(steps: list[Step]) -> list[int]:
    """The indices of the all-gathers the runtime runs again in backward when the source is a
    sharded trainable parameter (:mod:`autopar.comm.regather`), assuming the consumer saves the
    tensor for its backward: all of them when the consumer reads the last gathered tensor itself
    or a dim-0 block of it (:func:`autopar.comm.plain.chunk` returns that as a view), none when
    another step follows the gathers (autograd then saves that step's output)."""
    gathers = next((i for i, s in enumerate(steps) if s.kind != "all_gather"), len(steps))
    if any(s.kind != "chunk" or s.dim != 0 for s in steps[gathers:]):
        return []
    return list(range(gathers))


def step_collectives(steps: list[Step], src: Sharding, mesh_shape, *, backward=None, pending=(),
                     regather: bool = False) -> tuple[tuple[str, str, int, int], ...]:
    """``(phase, kind, mesh axis, pieces)`` of the collectives ``steps`` run from ``src``, in the
    order they run: each moves the tensor's bytes / ``pieces`` per rank. ``backward``: each step's
    adjoint (None: no gradient flows); ``pending``: mesh axes whose gradient is all-reduced at the
    source; ``regather``: the source is a sharded parameter (trained or frozen) gathered again in
    backward."""
    state = list(src)
    sizes = []
    for step in steps:
        before = _pieces(state, mesh_shape)
        state[step.axis] = step.placement
        sizes.append(min(before, _pieces(state, mesh_shape)))  # the larger buffer
    out = [("forward", s.kind, s.axis, n) for s, n in zip(steps, sizes) if s.kind in COLLECTIVE_KINDS]
    if regather:  # a frozen parameter too: its consumers' backward may need it
        out += [("backward", "all_gather", steps[i].axis, sizes[i]) for i in regathered(steps)]
    if backward is None:
        return tuple(out)
    out += [("backward", backward[i], steps[i].axis, sizes[i]) for i in reversed(range(len(steps)))
            if backward[i] in COLLECTIVE_KINDS]
    whole = _pieces(src, mesh_shape)
    out += [("backward", "all_reduce", a, whole) for a in sorted(pending, reverse=True)]
    return tuple(out)


def edge_collectives(src: Sharding, dst: Sharding, mesh_shape, *, ndim: int, kinds=None,
                     regather: bool = False) -> tuple[tuple[str, str, int, int], ...]:
    """:func:`step_collectives` of the edge ``src -> dst`` into a consumer that hands back
    gradients of ``kinds`` (one per mesh axis, see :func:`input_kind`; None: no gradient) to a
    source with no other consumer (:func:`lone_backward`)."""
    steps = plan_steps(src, dst, ndim=ndim, mesh_shape=mesh_shape)
    if kinds is None:
        return step_collectives(steps, src, mesh_shape, regather=regather)
    backward, pending = lone_backward(steps, kinds)
    return step_collectives(steps, src, mesh_shape, backward=backward, pending=pending, regather=regather)


def price(src: Sharding, dst: Sharding, *, shape, itemsize: int, mesh_shape, kinds=None,
          regather: bool = False) -> list[Collective]:
    """The collectives of :func:`edge_collectives` for a tensor of global ``shape``."""
    nbytes = math.prod(shape) * itemsize
    return [Collective(phase, kind, axis, nbytes / pieces) for phase, kind, axis, pieces in
            edge_collectives(src, dst, mesh_shape, ndim=len(shape), kinds=kinds, regather=regather)]


__all__ = ["ADJOINTS", "DEFAULT_BACKWARD", "FLEXIBLE", "KINDS", "Step", "edge_collectives", "input_kind",
           "lone_backward", "plan_steps", "price", "regathered", "step_collectives", "walk_back"]
