"""Collectives over one mesh axis without autograd: what the differentiable collectives run
forward and backward, and what gathers a sharded tensor whole.

Each takes this rank's tensor and ``ax``, an :class:`~autopar.comm.mesh.AxisGroup` (the axis's
size, this rank's coordinate, its process group), and returns a new tensor; over an axis of
size 1 they return their input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.comm.mesh import AxisGroup
from autopar.comm.record import issuing, nbytes_of


def _wire(x: torch.Tensor) -> torch.Tensor:
    """gloo has no bool collectives: send booleans as bytes."""
    return x.to(torch.uint8) if x.dtype == torch.bool else x


def all_reduce(x: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """The sum of ``x`` over the axis."""
    if ax.size == 1:
        return x
    with issuing("all_reduce", ax.group, nbytes_of(x)) as made:
        out = _wire(x).clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ax.group)
        out = out.to(x.dtype)
        made(out)
    return out


def all_gather(x: torch.Tensor, ax: AxisGroup, dim: int) -> torch.Tensor:
    """The axis's pieces of ``x`` concatenated along ``dim``, coordinate 0 first."""
    if ax.size == 1:
        return x
    with issuing("all_gather", ax.group, ax.size * nbytes_of(x)) as made:
        src = _wire(x).movedim(dim, 0).contiguous()
        out = src.new_empty((ax.size * src.shape[0],) + tuple(src.shape[1:]))
        dist.all_gather_single(out, src, group=ax.group)
        out = out.movedim(0, dim).contiguous().to(x.dtype)
        made(out)
    return out


def reduce_scatter(x: torch.Tensor, ax: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's block of ``dim`` of the sum of ``x`` over the axis."""
    if ax.size == 1:
        return x
    with issuing("reduce_scatter", ax.group, nbytes_of(x)) as made:
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // ax.size,) + tuple(src.shape[1:]))
        dist.reduce_scatter_single(out, src, group=ax.group)
        out = out.movedim(0, dim).contiguous()
        made(out)
    return out


def chunk(x: torch.Tensor, ax: AxisGroup, dim: int) -> torch.Tensor:
    """This rank's block of ``dim`` (no traffic), contiguous: a view where the block already is
    (a block of rows), or where its storage is smaller than the block (a broadcast view, e.g. an
    expanded gather index, which a copy would materialise at full size)."""
    size = x.shape[dim] // ax.size
    block = x.narrow(dim, ax.coord * size, size)
    if block.untyped_storage().nbytes() < nbytes_of(block):
        return block
    return block.contiguous()


def zero_pad(x: torch.Tensor, ax: AxisGroup, dim: int) -> torch.Tensor:
    """The inverse placement of :func:`chunk`: this rank's piece in a zero tensor of full size."""
    shape = list(x.shape)
    shape[dim] *= ax.size
    out = x.new_zeros(shape)
    out.narrow(dim, ax.coord * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def all_to_all(x: torch.Tensor, ax: AxisGroup, gather_dim: int, split_dim: int) -> torch.Tensor:
    """Re-shard over the axis: ``x`` split along ``split_dim``, the pieces received concatenated
    along ``gather_dim``."""
    if ax.size == 1:
        return x
    with issuing("all_to_all", ax.group, nbytes_of(x)) as made:
        src = torch.stack(_wire(x).chunk(ax.size, dim=split_dim)).contiguous()
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src, group=ax.group)
        out = torch.cat(out.unbind(0), dim=gather_dim).to(x.dtype)
        made(out)
    return out


def keep_on_first(x: torch.Tensor, ax: AxisGroup) -> torch.Tensor:
    """``x`` at coordinate 0 of the axis, zeros elsewhere (a replicated value as a pending sum)."""
    return x if ax.coord == 0 else torch.zeros_like(x)


__all__ = ["all_gather", "all_reduce", "all_to_all", "chunk", "keep_on_first", "reduce_scatter", "zero_pad"]
