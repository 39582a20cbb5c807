"""Moving a tensor between two sub-meshes: which rank sends which block to which rank.

A pipeline boundary value leaves one stage's mesh in one sharding and enters the next stage's
mesh, possibly of another shape and size, in another (:mod:`autopar.plan.split`). Each
receiving rank needs the :class:`~autopar.core.layout.Piece` its sharding gives it; every
sending rank whose piece overlaps it holds the overlap, and among the sending ranks holding the
same piece (replicas) one is picked, the one with the fewest elements to send so far (ties: the
lowest rank), so replicas share the load. The plan is static and computed alike on every rank::

    >>> [(t.src, t.dst, t.starts, t.stops) for t in transfers((4, 2), (Shard(0),), (2,), (0, 1),
    ...                                                        (Replicate(),), (1,), (2,))]
    [(0, 2, (0, 0), (2, 2)), (1, 2, (2, 0), (4, 2))]

Gradients go back along the reverse plan (the receivers as holders): every rank of both stages
holds the whole gradient of its piece (:mod:`autopar.plan.gradients` hands a boundary output an
``R`` gradient and sums a replicated input's), so any replica can send it.

Per rank a transfer moves the overlap's bytes once: a receiver takes its whole piece, a sender
its share of every receiver's overlap with its piece. :func:`links` plans every value a pipeline
stage sends the next, and :func:`sent_blocks` lists the blocks one rank sends per micro-batch:
what it puts on the wire, which the plan records and ``verify`` logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.core.errors import ShardingError
from autopar.core.layout import coord_of, piece_of
from autopar.core.placement import Partial


@dataclass(frozen=True)
class Transfer:
    """Global rank ``src`` sends rank ``dst`` the block ``[starts, stops)`` of the global tensor."""

    src: int
    dst: int
    starts: tuple[int, ...]
    stops: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.starts, self.stops))

    def cuts(self, piece) -> tuple[tuple[int, int, int], ...]:
        """``(dim, start, length)`` narrowings of ``piece``'s local tensor that give the block."""
        return tuple((d, a - p, b - a) for d, (a, b, p, n) in
                     enumerate(zip(self.starts, self.stops, piece.starts, piece.shape)) if (a - p, b - a) != (0, n))

    def block(self, local, piece):
        """The block, a view of ``local`` (a rank's tensor of ``piece``)."""
        for d, start, length in self.cuts(piece):
            local = local.narrow(d, start, length)
        return local


def pieces(shape, sharding, mesh_shape, ranks) -> dict:
    """Global rank -> its :class:`~autopar.core.layout.Piece` of a ``shape`` tensor under ``sharding``."""
    if any(isinstance(p, Partial) for p in sharding):
        raise ShardingError("a pending sum cannot cross meshes: reduce it before it leaves its stage")
    return {r: piece_of(tuple(shape), sharding, mesh_shape, coord_of(i, mesh_shape)) for i, r in enumerate(ranks)}


def transfers(shape, src_sharding, src_mesh, src_ranks, dst_sharding, dst_mesh, dst_ranks) -> list[Transfer]:
    """The blocks that carry a ``shape`` tensor held ``src_sharding`` on ``src_mesh`` (global
    ``src_ranks``, row-major) to ``dst_sharding`` on ``dst_mesh`` (module docstring), in receiver
    order, then by block start."""
    held: dict = {}
    for r, p in pieces(shape, src_sharding, src_mesh, src_ranks).items():
        held.setdefault((p.starts, p.stops), []).append(r)
    load = dict.fromkeys(src_ranks, 0)
    out = []
    for dst, want in pieces(shape, dst_sharding, dst_mesh, dst_ranks).items():
        for (starts, stops), replicas in sorted(held.items()):
            lo = tuple(max(a, b) for a, b in zip(starts, want.starts))
            hi = tuple(min(a, b) for a, b in zip(stops, want.stops))
            if any(a >= b for a, b in zip(lo, hi)) and math.prod(shape):
                continue
            src = min(replicas, key=lambda r: (load[r], r))
            load[src] += math.prod(b - a for a, b in zip(lo, hi))
            out.append(Transfer(src, dst, lo, hi))
    return out


@dataclass(frozen=True)
class Link:
    """Value ``index`` of the ``count`` values stage ``k`` sends stage ``k + 1``: its blocks forward
    and, when it carries a gradient, back, with each side's pieces by global rank."""

    index: int
    count: int
    forward: tuple
    backward: tuple
    sender_pieces: dict
    receiver_pieces: dict


def links(stages, stage_graphs) -> list[list[Link]]:
    """Per stage ``k`` but the last, the :class:`Link` s of the values it sends stage ``k + 1``
    (``stages``: the plan's, with ``mesh_shape`` and ``ranks``; ``stage_graphs``: their split
    graphs, whose ``outputs`` / ``inputs`` are the boundary values in the same order)."""
    out = []
    for a, b, ga, gb in zip(stages, stages[1:], stage_graphs, stage_graphs[1:]):
        mine = []
        for i, (sent, got) in enumerate(zip(ga.outputs, gb.inputs)):
            src = (sent.sharding, tuple(a.mesh_shape), tuple(a.ranks))
            dst = (got.sharding, tuple(b.mesh_shape), tuple(b.ranks))
            fwd = transfers(sent.shape, *src, *dst)
            bwd = transfers(sent.shape, *dst, *src) if got.requires_grad else []
            mine.append(Link(i, len(ga.outputs), tuple(fwd), tuple(bwd), pieces(sent.shape, *src),
                             pieces(sent.shape, *dst)))
        out.append(mine)
    return out


def sent_blocks(all_links: list[list[Link]], stage: int, rank: int) -> list[tuple[str, int, Transfer]]:
    """``(phase, value index, block)`` of every block global ``rank`` of ``stage`` sends per
    micro-batch: forward its outputs' blocks to the next stage, backward the gradients' blocks of
    what it received to the one before."""
    out = [("forward", link.index, t) for link in (all_links[stage] if stage < len(all_links) else ())
           for t in link.forward if t.src == rank]
    if stage > 0:
        out += [("backward", link.index, t) for link in all_links[stage - 1] for t in link.backward if t.src == rank]
    return out


__all__ = ["Link", "Transfer", "links", "pieces", "sent_blocks", "transfers"]
