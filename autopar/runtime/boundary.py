"""Boundary values between pipeline stages, moved point to point on the default process group.

:func:`~autopar.core.crossmesh.links` computes, once per program, for each pair of neighbouring stages and each value
the first sends the second, the blocks that carry it forward and its gradient back
(:func:`autopar.core.crossmesh.transfers` from the sender's boundary sharding on its mesh to the
receiver's on its own). On equal meshes every rank sends its whole piece to the rank at the same
coordinate of the next stage; on different meshes a receiver gathers its piece from the senders
holding its rows, replicas sharing the load, and gradients go back the reverse way.

A :class:`Port` is one rank's side of one link: :meth:`Port.send` posts ``dist.isend`` s of its
blocks and keeps them until they complete; :meth:`Port.receive` posts the ``dist.irecv`` s into
buffers allocated for the whole step (:meth:`Port.buffers`, one per micro-batch, as the stage
memory model counts them) and waits for them (the schedule receives in its own order, so a rank
waits only for what it needs next). Tags are unique per micro-batch, direction and value, so
blocks cannot pair wrongly.

**Cost.** Per micro-batch and direction, a value of ``n`` rows on its batch dim goes from a stage
on ``(dp_s, tp_s)`` to one on ``(dp_r, tp_r)`` (powers of two). A receiver takes its piece,
``n / dp_r`` rows (``n`` where it is not split), in one message per sender piece it overlaps. A
sender piece of ``n / dp_s`` rows goes, in blocks, to the ``tp_r`` ranks of each receiver group
that needs it, whole blocks shared out among its ``tp_s`` replicas, so the busiest sender moves
at most ``max(1, tp_r / tp_s)`` times its piece. On equal meshes both are one message of
``n / dp`` rows, what the planner prices (:func:`autopar.planner.stage_table.stage_arrays`:
``2·(boundary / bandwidth + latency)`` with the boundary at the sender's ``dp``); on different
meshes the busiest rank moves at most ``max(1, tp_r / tp_s, dp_s / dp_r)`` times that, the
factor the plan prices. The stage DP prices a stage without knowing its neighbour's mesh (Alpa's
leaves cross-mesh resharding out too); the Plan made from its choice adds the difference
(:func:`autopar.planner.pipeline_plan.cross_mesh_excess`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.core.crossmesh import Link
from autopar.runtime.pipeline_stage import wire_dtype

FORWARD, BACKWARD = 0, 1


class Port:
    """This rank's side of the links between two stages (module docstring)."""

    def __init__(self, links_: list[Link], boundaries, *, rank: int, device: torch.device):
        self.links = links_
        self.boundaries = boundaries  # this side's Boundary per value (its local shape and dtype)
        self.rank = rank
        self.device = device
        self.pending: list = []

    def _tag(self, link: Link, micro_batch: int, direction: int) -> int:
        return (micro_batch * 2 + direction) * link.count + link.index

    def send(self, values, micro_batch: int, direction: int) -> None:
        """Post the blocks of ``values`` (this rank's pieces, one per link; None: zeros) this rank sends."""
        for link, value, b in zip(self.links, values, self.boundaries):
            blocks = link.forward if direction == FORWARD else link.backward
            mine = link.sender_pieces if direction == FORWARD else link.receiver_pieces
            for t in blocks:
                if t.src != self.rank:
                    continue
                if value is None:  # a gradient that never arrived at its input: zeros
                    value = torch.zeros(mine[self.rank].shape, dtype=wire_dtype(b.dtype), device=self.device)
                block = t.block(value.detach(), mine[self.rank])
                block = block.to(wire_dtype(block.dtype)).contiguous()
                self.pending.append((dist.isend(block, t.dst, tag=self._tag(link, micro_batch, direction)), block))
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def buffers(self, direction: int, wanted) -> list:
        """Empty tensors for this rank's piece of each value whose ``wanted`` flag is set (else None)."""
        out = []
        for link, b, want in zip(self.links, self.boundaries, wanted):
            mine = link.receiver_pieces if direction == FORWARD else link.sender_pieces
            out.append(torch.empty(mine[self.rank].shape, dtype=wire_dtype(b.dtype), device=self.device)
                       if want else None)
        return out

    def receive(self, bufs, micro_batch: int, direction: int) -> None:
        """Fill ``bufs`` (from :meth:`buffers`) with this rank's pieces, waiting until they are whole."""
        works = []
        for link, buf in zip(self.links, bufs):
            if buf is None:
                continue
            blocks = link.forward if direction == FORWARD else link.backward
            piece = (link.receiver_pieces if direction == FORWARD else link.sender_pieces)[self.rank]
            for t in blocks:
                if t.dst != self.rank:
                    continue
                view = t.block(buf, piece)
                into = view if view.is_contiguous() else torch.empty_like(view)
                works.append((dist.irecv(into, t.src, tag=self._tag(link, micro_batch, direction)), into, view))
        for work, into, view in works:
            work.wait()
            if into is not view:
                view.copy_(into)

    def finish(self) -> None:
        """Wait for every block this rank has posted."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []


__all__ = ["BACKWARD", "FORWARD", "Port"]
